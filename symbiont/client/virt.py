"""VirtLayers: stand-ins for frozen linear modules whose math runs on a base executor.

A VirtLayer subclasses the module type it replaces and carries a zero-storage weight
(one scalar expanded to the full shape), so PEFT, transformers and user code that look
at `weight.shape`, `dtype`, `device`, `in_features`/`out_features` or `nf`/`nx` see
exactly what they would see on the real module, while no memory is spent on it.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from symbiont.client.fusion import Fusion, LocalFusion, fusion_for
from symbiont.model.layers import LayerSpec
from symbiont.protocol.executor import Executor, Op


class _BaseLayerCall(torch.autograd.Function):
    """y = base(x) with backward grad_x = executor.backward(grad_y).

    Saves no tensors: a frozen linear layer's input gradient needs only the weight,
    which the executor already holds (Symbiosis 3.6). So neither side keeps activations.
    One node per layer, also when the forward was fused: autograd then sums grad_x over
    q/k/v in the order vanilla's own Linear nodes do, so gradients stay bitwise equal.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: VirtLayer) -> torch.Tensor:
        ctx.layer = layer
        return _owned(layer.call_executor(Op.FORWARD, x))

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        # a Function of its own, so that create_graph=True (gradient penalties) records it
        grad_x = _InputGradCall.apply(grad_y.contiguous(), ctx.layer)
        return grad_x, None


class _InputGradCall(torch.autograd.Function):
    """grad_x = grad_y W, a frozen layer's input gradient, itself differentiable for
    second-order gradients: its derivative applies Wᵀ, the layer's forward without its
    bias. (Without this, a gradient penalty's gradient was silently wrong.)"""

    @staticmethod
    def forward(ctx, grad_y: torch.Tensor, layer: VirtLayer) -> torch.Tensor:
        ctx.layer = layer
        return layer.call_executor(Op.BACKWARD, grad_y)

    @staticmethod
    def backward(ctx, grad_grad_x: torch.Tensor):
        layer = ctx.layer
        y = layer.call_unfused(Op.FORWARD, grad_grad_x.contiguous())
        if layer.bias is not None:
            y = y - layer.bias.to(y.dtype)
        return y, None


def _owned(y: torch.Tensor) -> torch.Tensor:
    """y, or a copy of it when it is a view of a fused call's output: autograd forbids
    in-place edits (AdaLoRA's `result +=`) of views made without grad. [n, out] -> same"""
    return y if y._base is None else y.clone(memory_format=torch.contiguous_format)


class VirtLayer:
    """Mixin holding the executor link; concrete classes also subclass the replaced type."""

    spec: LayerSpec
    _fusion: LocalFusion | None = None

    @property
    def executor(self) -> Executor:
        return self._executor

    @executor.setter
    def executor(self, executor: Executor) -> None:
        # Forward calls fuse (q/k/v, gate/up: one call, one matmul) when the executor
        # computes them in one pass; a masking wrapper is called one layer at a time.
        self._executor = executor
        self._fusion = fusion_for(executor) if executor.fuses_calls else None

    def _link(self, executor: Executor, spec: LayerSpec, dtype: torch.dtype, device) -> None:
        self.executor = executor
        self.spec = spec
        self.wire_dtype = executor.manifest.dtype
        self.register_parameter("weight", _zero_storage(self._weight_shape(), dtype, device))
        # The bias is [out], small: the client holds its real values (the loader reads them
        # like any client tensor), so methods that transform the layer's output (BOFT's
        # (base(x) - b) * s + b) compute exactly as vanilla. The executor still adds it.
        bias = None
        if spec.has_bias:
            bias = nn.Parameter(torch.empty(spec.out_features, dtype=dtype, device="meta"))
            bias.requires_grad_(False)
        self.register_parameter("bias", bias)

    def _weight_shape(self) -> tuple[int, int]:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None and self.bias.requires_grad:  # LoraConfig(bias='all'), ...
            raise BaseWeightUnavailable(_TRAIN_BIAS_MESSAGE)
        flat = x.reshape(-1, x.shape[-1])  # [n_tokens, in]: the executor sees flattened tokens
        if not torch.is_grad_enabled():
            y = self.call_executor(Op.FORWARD, flat)
        elif x.requires_grad:
            y = _BaseLayerCall.apply(flat, self)
        else:
            y = _owned(self.call_executor(Op.FORWARD, flat))
        return y.view(*x.shape[:-1], self.spec.out_features)

    def call_executor(self, op: Op, x: torch.Tensor) -> torch.Tensor:
        """One executor call in the executor's dtype; the result comes back in x's dtype.
        x [n_tokens, width_in] -> [n_tokens, width_out]"""
        if self._fusion is not None and op is Op.FORWARD:
            return self._forward_fused(self._fusion.state, x)
        if x.dtype == self.wire_dtype:  # the common case: skip two no-op casts per call
            return self._executor.call(op, self.spec.id, x)
        return self._executor.call(op, self.spec.id, x.to(self.wire_dtype)).to(x.dtype)

    def call_unfused(self, op: Op, x: torch.Tensor) -> torch.Tensor:
        """One call of this layer alone (a tensor no sibling layer will take)."""
        if x.dtype == self.wire_dtype:
            return self._executor.call(op, self.spec.id, x)
        return self._executor.call(op, self.spec.id, x.to(self.wire_dtype)).to(x.dtype)

    def _forward_fused(self, fusion: Fusion, x: torch.Tensor) -> torch.Tensor:
        """This layer's output on x, computed by one call with the layers that follow it
        on the same x (or taken from such a call). x [n_tokens, in] -> [n_tokens, out],
        possibly a view of the fused call's [n_tokens, sum_out]."""
        layer = self.spec.id
        ready = fusion.take(layer, x)
        if ready is not None:
            return ready
        extra = fusion.plan(layer, x)
        wire = x if x.dtype == self.wire_dtype else x.to(self.wire_dtype)
        if not extra:
            y = self._executor.call(Op.FORWARD, layer, wire)
            return y if wire is x else y.to(x.dtype)
        outs = self._executor.forward_fused((layer, *extra), wire)  # one matmul
        if wire is not x:
            outs = [y.to(x.dtype) for y in outs]
        fusion.keep(x, extra, outs[1:])
        return outs[0]

    def _apply(self, fn, recurse=True):
        # Module.to()/cuda()/half() would materialise the expanded weight; move the
        # one stored scalar instead and expand it again. The bias is real: moved as usual.
        weight = self._parameters["weight"]
        moved = fn(torch.zeros((), dtype=weight.dtype, device=weight.device))
        self._parameters["weight"] = _zero_storage(weight.shape, moved.dtype, moved.device)
        bias = self._parameters.get("bias")
        if bias is not None and not bias.is_meta:
            self._parameters["bias"] = nn.Parameter(fn(bias.data), requires_grad=False)
        return self

    def extra_repr(self) -> str:
        return f"{self.spec.in_features} -> {self.spec.out_features}, layer={self.spec.id} (on executor)"


class VirtLinear(VirtLayer, nn.Linear):
    def __init__(self, executor: Executor, spec: LayerSpec, dtype: torch.dtype, device):
        nn.Module.__init__(self)  # nn.Linear.__init__ would allocate the weight
        self.in_features, self.out_features = spec.in_features, spec.out_features
        self._link(executor, spec, dtype, device)

    def _weight_shape(self) -> tuple[int, int]:
        return (self.spec.out_features, self.spec.in_features)

    forward = VirtLayer.forward


class VirtConv1D(VirtLayer, Conv1D):
    def __init__(self, executor: Executor, spec: LayerSpec, dtype: torch.dtype, device):
        nn.Module.__init__(self)  # Conv1D.__init__ would allocate the weight
        self.nx, self.nf = spec.in_features, spec.out_features
        self._link(executor, spec, dtype, device)

    def _weight_shape(self) -> tuple[int, int]:
        return (self.spec.in_features, self.spec.out_features)

    forward = VirtLayer.forward

    def __repr__(self) -> str:
        return f"VirtConv1D({self.extra_repr()})"


class BaseWeightUnavailable(RuntimeError):
    """Client code tried to read a base weight, which only the executor holds."""


# Where in the stack a weight read comes from -> the PEFT feature to name in the error.
_WEIGHT_READERS = {
    "peft.tuners.lora.dora": "DoRA (LoraConfig(use_dora=True))",
    "peft.tuners.lora.corda": "CorDA initialisation (init_lora_weights='corda')",
    "peft.tuners.lora.eva": "EVA initialisation (init_lora_weights='eva')",
    "peft.utils.loftq_utils": "LoftQ initialisation (init_lora_weights='loftq')",
    "trl.kernels.chunked_logprob": "TRL's fused LM head (the SFTTrainer loss)",
    "peft.tuners.trainable_tokens.layer": "trainable tokens on tied embeddings",
}
# What to do instead, where it is not "use another PEFT method".
_WEIGHT_READER_ADVICE = {
    "trainable tokens on tied embeddings": (
        "PEFT also wraps the output layer tied to the embeddings and reads its weight. Load "
        "the client with load_client(..., local_lm_head=True): free when the output layer "
        "is tied to the input embeddings, and then trainable tokens run exactly."
    ),
    "TRL's fused LM head (the SFTTrainer loss)": (
        "Load the client with load_client(..., local_lm_head=True) to keep the output "
        "projection on the client (free when it is tied to the input embeddings)."
    ),
}
_PEFT_ADVICE = (
    "Use a PEFT method that runs split (LoRA, DoRA, AdaLoRA, IA3, LoHa, LoKr, VeRA, OFT, "
    "BOFT, HRA, prefix/prompt tuning, ...); "
    "see docs/compatibility.md"
)
_SHARED_BASE_ADVICE = (
    "It initialises the adapter from the base weight and (PiSSA, OLoRA, CorDA, LoftQ) "
    "rewrites it, but the base is shared: every tenant of the executor computes with the "
    "same frozen weights, which no tenant may change. Initialise the adapter without the "
    "base (init_lora_weights=True or 'gaussian'); see docs/compatibility.md"
)
_WEIGHT_READER_FUNCTIONS = {
    "pissa_init": "PiSSA initialisation (init_lora_weights='pissa')",
    "olora_init": "OLoRA initialisation (init_lora_weights='olora')",
    "merge": "merging adapters into base weights (merge_adapter / merge_and_unload)",
    "unmerge": "merging adapters into base weights (merge_adapter / merge_and_unload)",
}
# Tensor attributes that describe a weight without reading it; `data` yields the
# weight itself so code that inspects `weight.data.shape` still sees the right shape.
_READ_FREE = frozenset(
    {
        "size",
        "dim",
        "numel",
        "nelement",
        "element_size",
        "is_floating_point",
        "is_complex",
        "requires_grad_",
        "detach",
        "__get__",
        "__set__",
        "untyped_storage",
        "data_ptr",
        "stride",
        "storage_offset",
        "is_contiguous",
        "get_device",
    }
)
_VALUE_PROPERTIES = frozenset({"T", "mT", "H", "mH", "real", "imag"})


_TRAIN_BIAS_MESSAGE = (
    "training a frozen base layer's bias (PEFT's bias='all' or 'lora_only'): the executor "
    "adds the frozen bias, shared by every tenant, so the trained one would be silently "
    "ignored. Use bias='none' (the LoRA default)"
)
_TRAIN_BASE_MESSAGE = (
    "training a frozen base weight (requires_grad=True on it: full fine-tuning, or PEFT's "
    "modules_to_save on a base layer such as lm_head): in split execution its values stay "
    "on the base executor, shared by every tenant, so it would silently not train. Train "
    "an adapter on it instead (LoRA on lm_head, say), or load the client with "
    "load_client(..., local_lm_head=True) to keep the output layer on the client"
)


def _wants_grad(args, kwargs, key: str) -> bool:
    value = args[1] if len(args) > 1 else (kwargs or {}).get(key, True)
    return bool(value)


class RemoteWeight(nn.Parameter):
    """A frozen weight of the right shape, dtype and device whose values live on the
    executor. Backed by one element; any read of its values raises a clear error
    instead of silently computing with placeholder zeros."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "__set__":
            prop = getattr(getattr(func, "__self__", None), "__name__", "")
            if prop == "requires_grad" and len(args) > 1 and bool(args[1]):
                raise BaseWeightUnavailable(_TRAIN_BASE_MESSAGE)
        if name == "__get__":
            prop = getattr(getattr(func, "__self__", None), "__name__", "")
            if prop == "data":
                return args[0]
            if prop not in _VALUE_PROPERTIES:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **(kwargs or {}))
        elif name == "detach":
            return args[0]
        elif name == "requires_grad_" and _wants_grad(args, kwargs, "requires_grad"):
            raise BaseWeightUnavailable(_TRAIN_BASE_MESSAGE)
        elif name in _READ_FREE:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise BaseWeightUnavailable(_weight_read_message(name))

    def __deepcopy__(self, memo):
        return _zero_storage(self.shape, self.dtype, self.device)

    def __reduce_ex__(self, protocol):
        # torch.save / pickle of a client's state_dict recursed without end here
        raise BaseWeightUnavailable(
            f"saving a frozen base weight {list(self.shape)}: in split execution its values "
            "stay on the base executor. Save the adapter (save_pretrained on the PEFT "
            "model saves only the adapter's tensors), or use the base checkpoint itself"
        )

    def __repr__(self) -> str:
        return f"RemoteWeight(shape={list(self.shape)}, dtype={self.dtype}, on the base executor)"


def _weight_read_message(op: str) -> str:
    feature = _feature_reading_weights()
    what = f"{feature} needs" if feature else f"torch operation {op!r} needs"
    return (
        f"{what} the values of a frozen base weight, but in split execution the base "
        "weights stay on the base executor and the client holds only a placeholder. "
        + _WEIGHT_READER_ADVICE.get(
            feature, _SHARED_BASE_ADVICE if "initialisation" in (feature or "") else _PEFT_ADVICE
        )
    )


def _feature_reading_weights() -> str | None:
    frame = inspect.currentframe()
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module in _WEIGHT_READERS:
            return _WEIGHT_READERS[module]
        if module.startswith("peft.") and frame.f_code.co_name in _WEIGHT_READER_FUNCTIONS:
            return _WEIGHT_READER_FUNCTIONS[frame.f_code.co_name]
        frame = frame.f_back
    return None


def _zero_storage(shape, dtype, device) -> RemoteWeight:
    """A frozen parameter of `shape` backed by a single element."""
    scalar = torch.zeros((), dtype=dtype, device=device)
    return RemoteWeight(scalar.expand(shape), requires_grad=False)


def make_virt_layer(
    original: nn.Module, executor: Executor, spec: LayerSpec, dtype, device
) -> VirtLayer:
    from symbiont.client import dora, weight_methods  # they import this module: deferred

    dora.install()  # DoRA's row norms through the executor (symbiont/client/dora.py)
    weight_methods.install()  # HRA, SHiRA, DeLoRA as base-layer calls
    cls = VirtConv1D if isinstance(original, Conv1D) else VirtLinear
    return cls(executor, spec, dtype, device)
