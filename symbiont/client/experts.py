"""VirtExperts: stand-ins for a mixture-of-experts stack whose weights stay on the executor.

The family's own router still runs on the client (its small weight is a client tensor,
so the top-k, softmax and normalisation are exactly the family's, and PEFT can adapt it);
the experts module it feeds is replaced by a VirtExperts that sends the hidden states
with the router's choices to the executor (`Executor.call_experts`), which runs the
family's own experts module on them and returns the weighted sum.

A VirtExperts subclasses the experts class it replaces and carries zero-storage weights
of the right shapes, so code that inspects the module sees what it would see on the
real one; reading those weights' values raises an error that says why.
"""

from __future__ import annotations

import torch
from torch import nn

from symbiont.client.virt import BaseWeightUnavailable, RemoteWeight
from symbiont.model.moe import ExpertsSpec
from symbiont.protocol.executor import Executor, Op

EXPERTS_LORA_MESSAGE = (
    "LoRA on expert weights (PEFT's LoraConfig(target_parameters=[...experts.gate_up_proj / "
    "down_proj]), which PEFT also adds for target_modules='all-linear' on MoE models) needs "
    "the values of the experts' weights, which stay on the base executor: in split "
    "execution the experts run there as one op. Adapt the attention, the shared experts or "
    "the router instead, naming them (e.g. target_modules=['q_proj', 'k_proj', 'v_proj', "
    "'o_proj'], target_parameters=['mlp.gate.weight']); see docs/compatibility.md"
)


class ExpertWeight(RemoteWeight):
    """A stacked expert weight held by the executor; reading its values names the cause
    (PEFT's `target_parameters` on experts) instead of a torch op."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        try:
            return super().__torch_function__(func, types, args, kwargs)
        except BaseWeightUnavailable:
            raise BaseWeightUnavailable(EXPERTS_LORA_MESSAGE) from None

    def __deepcopy__(self, memo):
        return _expert_weight(self.shape, self.dtype, self.device)

    def __repr__(self) -> str:
        return f"ExpertWeight(shape={list(self.shape)}, dtype={self.dtype}, on the base executor)"


def _expert_weight(shape, dtype, device) -> ExpertWeight:
    scalar = torch.zeros((), dtype=dtype, device=device)
    return ExpertWeight(scalar.expand(shape), requires_grad=False)


class _ExpertsCall(torch.autograd.Function):
    """y = experts(hidden, ids, weights), backward through the executor.

    Unlike a linear layer, the experts' input gradient depends on the input, so the
    client keeps hidden, ids and weights for backward (its own tensors) and the
    executor recomputes the forward from them: the executor keeps nothing."""

    @staticmethod
    def forward(ctx, hidden, weights, ids, experts):
        ctx.experts = experts
        ctx.save_for_backward(hidden, weights, ids)
        return experts.call_executor(Op.EXPERTS_FORWARD, hidden, ids, weights)[0]

    @staticmethod
    @torch.autograd.function.once_differentiable  # second-order gradients: an error, not 0
    def backward(ctx, grad_y):
        hidden, weights, ids = ctx.saved_tensors
        grad_hidden, grad_weights = ctx.experts.call_executor(
            Op.EXPERTS_BACKWARD, hidden, ids, weights, grad_y.contiguous()
        )
        return grad_hidden, grad_weights, None, None


class VirtExperts:
    """Mixin holding the executor link; concrete classes also subclass the replaced type."""

    executor: Executor
    spec: ExpertsSpec

    def _link(self, original: nn.Module, executor: Executor, spec: ExpertsSpec, dtype, device):
        skip = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}
        self.__dict__.update({k: v for k, v in original.__dict__.items() if k not in skip})
        for name, child in original.named_children():  # act_fn and such: no weights
            self._modules[name] = child
        self.executor = executor
        self.spec = spec
        self.wire_dtype = executor.manifest.dtype
        self.weights_dtypes = (torch.float32, self.wire_dtype)
        for name, shape in spec.weights:
            owner, leaf = _owner(self, name)
            owner._parameters[leaf] = _expert_weight(shape, dtype, device)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        """hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k] -> [T, H]"""
        if hidden_states.shape[0] == 0:
            return torch.zeros_like(hidden_states)
        ids = top_k_index.to(torch.int64).contiguous()
        if torch.is_grad_enabled() and (hidden_states.requires_grad or top_k_weights.requires_grad):
            return _ExpertsCall.apply(hidden_states, top_k_weights, ids, self)
        return self.call_executor(Op.EXPERTS_FORWARD, hidden_states, ids, top_k_weights)[0]

    def call_executor(self, op, hidden, ids, weights, grad_y=None) -> tuple[torch.Tensor, ...]:
        """One executor call in its dtypes; results come back in the callers' dtypes."""
        wire_weights = weights if weights.dtype in self.weights_dtypes else weights.float()
        args = [hidden.to(self.wire_dtype).contiguous(), ids, wire_weights.contiguous()]
        if grad_y is not None:
            args.append(grad_y.to(self.wire_dtype))
        out = self.executor.call_experts(op, self.spec.id, *args)
        if op is Op.EXPERTS_FORWARD:
            return (out[0].to(hidden.dtype),)
        return out[0].to(hidden.dtype), out[1].to(weights.dtype)

    def _apply(self, fn, recurse=True):
        # Module.to()/half() would materialise the expanded weights: move one scalar each.
        for module in self.modules():
            for name, param in module._parameters.items():
                if isinstance(param, ExpertWeight):
                    moved = fn(torch.zeros((), dtype=param.dtype, device=param.device))
                    module._parameters[name] = _expert_weight(
                        param.shape, moved.dtype, moved.device
                    )
        return self

    def extra_repr(self) -> str:
        spec = self.spec
        return f"{spec.num_experts} experts, hidden {spec.hidden}, experts={spec.id} (on executor)"


def _owner(module: nn.Module, qualified: str) -> tuple[nn.Module, str]:
    path, _, leaf = qualified.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


_CLASSES: dict[type, type] = {}


def make_virt_experts(
    original: nn.Module, executor: Executor, spec: ExpertsSpec, dtype, device
) -> nn.Module:
    """A VirtExperts that is also an instance of `original`'s class (isinstance checks in
    transformers and PEFT keep working); its forward and weights are the executor's."""
    base = type(original)
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type(
            f"Virt{base.__name__}", (VirtExperts, base), {"forward": VirtExperts.forward}
        )
    virt = cls.__new__(cls)
    nn.Module.__init__(virt)  # the family's __init__ would allocate the weights
    virt._link(original, executor, spec, dtype, device)
    return virt
