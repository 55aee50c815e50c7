"""The serving forward of Llama-shaped decoders without transformers' module wrappers.

For Llama, Mistral and Qwen2 causal LMs the engine runs its flattened batch through this
loop instead of `model(...)`. It calls the same submodules in the same order as
transformers' code (every projection an adapter, a delta or a hook is on runs as its
module; bare VirtLayers as their executor calls, below) and `paged_attention` directly;
what it leaves out is
the Python around them: the output-capturing and kwargs decorators, the
`GradientCheckpointingLayer` wrapper, per-layer module dispatch, the causal-mask builder
(the paged attention builds its own) and the output dataclasses. On a CPU decode step of
a small model that Python is a large part of the step (BENCHMARKS.md, issue 17).

Two of its steps do the same arithmetic in fewer tensor operations, with bitwise equal
results in float32 (`tests/test_lean_forward.py`):
- RMSNorm as one `F.rms_norm` call (transformers: upcast, square, mean, rsqrt, two
  multiplies, downcast), only when the hidden states are float32; other dtypes call the
  module, whose rounding to the input dtype before the weight multiply differs;
- rotary position embedding applied to queries and keys together (one concatenation
  along heads, then transformers' `q * cos + rotate_half(q) * sin` once).

Projections that are bare VirtLayers of one executor (no adapter or delta around them, no
hooks) are not called as modules: the loop calls their executor directly, one
`forward_fused` for q/k/v and one for gate/up, the calls the VirtLayers make once their
fusion has learned the order (the first step's calls are per layer there), without their
module and fusion Python (`_project`; 1.05-1.09x faster decode steps of a
4.0M-parameter Llama, BENCHMARKS.md, session 15).

Given symbiont's CPU kernels (`ops`, layer_ops.py), float32 batches on a CPU also take
each residual add with the RMSNorm after it, and the rotary embedding of queries and keys,
in one pass each: the same results within float32 rounding (the norm's sum of squares
runs in another order), and fewer operations per layer.

`LeanForward.of` returns None for anything it does not know exactly (another
architecture, a subclassed layer, QK-norm, attention sinks); the runner then calls the
model as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _torch_module

from symbiont.client.virt import VirtLayer
from symbiont.protocol.executor import Op
from symbiont.serve.attention import paged_attention
from symbiont.serve.layer_ops import LayerOps

# model_type -> (module of the modeling code, class-name prefix): the classes whose
# forward this file reproduces (transformers 5.x)
KNOWN = {
    "llama": ("transformers.models.llama.modeling_llama", "Llama"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "Mistral"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2"),
}


@dataclass(frozen=True, slots=True)
class _Layer:
    attn: nn.Module  # its q/k/v/o projections are called; its layer_idx names the KV pool
    input_norm: nn.Module
    post_norm: nn.Module
    mlp: nn.Module
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    window: int | None
    # the executor's direct products of q/k/v, o, gate/up, down, each made on first use
    # (`_direct_product`); kept here, not on the modules, which a deep copy would copy
    products: tuple[list, ...] = field(
        default_factory=lambda: ([None], [None], [None], [None]), compare=False, repr=False
    )


class LeanForward:
    """`forward(ids | embeds, positions, keep_rows)` of the flattened batch -> logits."""

    def __init__(self, model: nn.Module, layers: list[_Layer], ops: LayerOps | None = None):
        self.ops = ops
        self.direct = True  # bare VirtLayers' executor called directly (`_project`)
        self.embed = model.model.embed_tokens
        self.rotary = model.model.rotary_emb
        self.norm = model.model.norm
        self.lm_head = model.lm_head
        self.layers = layers
        self.head_product = [None]  # the LM head's direct product (`_direct_product`)
        # in the order they run, each after a residual add but the first
        self.norms = [*(n for x in layers for n in (x.input_norm, x.post_norm)), self.norm]
        # modules whose forward the loop replaces: a hook on one needs transformers' forward
        self.skipped = [model, model.model, *model.model.layers, *(x.attn for x in layers)]

    def applies(self) -> bool:
        """False while a hook sits on a module whose forward this loop skips."""
        return not any(_hooked(module) for module in self.skipped)

    @classmethod
    def of(cls, model: nn.Module, ops: LayerOps | None = None) -> LeanForward | None:
        """The lean forward of `model`, or None where it would not be exactly the model's;
        with `ops`, float32 CPU batches take their norms and rotary through them."""
        known = KNOWN.get(getattr(model.config, "model_type", None))
        if known is None or getattr(model.config, "pretraining_tp", 1) != 1:
            return None
        import importlib

        modeling = importlib.import_module(known[0])
        prefix = known[1]
        classes = {
            name: getattr(modeling, prefix + name, None)
            for name in ("ForCausalLM", "Model", "DecoderLayer", "Attention", "MLP", "RMSNorm")
        }
        if None in classes.values() or type(model) is not classes["ForCausalLM"]:
            return None
        inner = model.model
        if type(inner) is not classes["Model"] or type(inner.norm) is not classes["RMSNorm"]:
            return None
        layers = []
        for layer in inner.layers[: model.config.num_hidden_layers]:
            if not _is_plain_layer(layer, classes):
                return None
            layers.append(_layer_of(layer, model.config))
        return cls(model, layers, ops)

    def __call__(
        self,
        ids: torch.Tensor | None,  # [n_tokens]
        embeds: torch.Tensor | None,  # [n_tokens, hidden] instead of ids (virtual tokens)
        positions: torch.Tensor,  # [n_tokens]
        keep_rows: torch.Tensor,  # [n_keep] rows whose logits are computed
    ) -> torch.Tensor:
        """-> [n_keep, vocab]; call under no_grad inside the step's `use_context`."""
        # [1, n, hidden]; the modules see transformers' shapes, for hooks on them (deltas)
        h = self.embed(ids[None]) if embeds is None else embeds[None]
        cos, sin = self.rotary(h, position_ids=positions[None])  # [1, n, head_dim] each
        ops = self.ops if self.ops is not None and LayerOps.fits(h) else None
        norms = self.norms
        h, x = _add_rms_norm(ops, norms[0], h, None)
        direct = self.direct
        for i, layer in enumerate(self.layers):
            a = self._attention(layer, x, cos, sin, ops, direct)
            h, x = _add_rms_norm(ops, norms[2 * i + 1], h, a)
            h, x = _add_rms_norm(ops, norms[2 * i + 2], h, _mlp(layer, x, direct))
        return _project((self.lm_head,), x[:, keep_rows], direct, self.head_product)[0][0]

    @staticmethod
    def _attention(
        layer: _Layer, x: torch.Tensor, cos, sin, ops: LayerOps | None, direct: bool
    ) -> torch.Tensor:
        """transformers' attention forward with the paged attention: [1, n, hidden] ->
        [1, n, hidden]. cos, sin: [1, n, hd]."""
        attn, n, hd = layer.attn, x.shape[1], layer.head_dim
        # [1, n, heads * hd], [1, n, kv_heads * hd] twice
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        q, k, v = _project(qkv, x, direct, layer.products[0])
        v = v.view(1, n, layer.kv_heads, hd).transpose(1, 2)  # [1, kv, n, hd]
        if ops is not None and LayerOps.rotary_fits(
            q, k, cos, sin, layer.heads, layer.kv_heads, hd
        ):
            qk = ops.rotary(q, k, cos, sin, layer.heads, layer.kv_heads)
        else:
            q = q.view(1, n, layer.heads, hd).transpose(1, 2)  # [1, heads, n, hd]
            k = k.view(1, n, layer.kv_heads, hd).transpose(1, 2)
            qk = torch.cat((q, k), dim=1)  # [1, heads + kv_heads, n, hd]
            cos, sin = cos[:, None], sin[:, None]  # [1, 1, n, hd]: broadcast over heads
            qk = qk * cos + _rotate_half(qk) * sin
        q, k = qk[:, : layer.heads], qk[:, layer.heads :]
        out, _ = paged_attention(
            attn, q, k, v, None, scaling=layer.scaling, sliding_window=layer.window
        )  # [1, n, heads, hd]
        out = out.reshape(1, n, -1).contiguous()
        return _project((attn.o_proj,), out, direct, layer.products[1])[0]


def _project(
    modules: tuple[nn.Module, ...], x: torch.Tensor, direct: bool, cell: list | None = None
) -> list[torch.Tensor]:
    """Each module's output on x ([1, n, in] -> [1, n, out] each), called in order.

    Where they are bare VirtLayers of one executor (no adapter or delta around them, no
    hooks) and no gradient is recorded (the engine's forward), the executor is called
    directly: one `forward_fused` for siblings (q/k/v), the VirtLayers' own call once their
    fusion has learned the order, without their module and fusion Python, which in a small
    model's decode step costs more than the product. An in-process serving executor's
    product bound to these layers (`direct_product`, kept in `cell`, one per call site)
    skips its call's lookups and checks too. The same results, bitwise, on the CPU
    (tests/test_lean_forward.py, tests/test_few_rows.py)."""
    if direct and not torch.is_grad_enabled():
        first = modules[0]
        if isinstance(first, VirtLayer) and x.dtype == first.wire_dtype:
            executor = first._executor
            if all(_bare(m, executor) for m in modules):
                flat = x.reshape(-1, x.shape[-1])  # [n, in]
                fused = len(modules) > 1
                outs = None
                if cell is not None and (not fused or first._fusion is not None):
                    product = _direct_product(cell, modules, executor)
                    if product is not None:
                        outs = product(flat)  # None: not an x it takes
                if outs is None and not fused:
                    outs = [executor.call(Op.FORWARD, first.spec.id, flat)]
                elif outs is None and first._fusion is not None:
                    outs = executor.forward_fused(tuple(m.spec.id for m in modules), flat)
                if outs is not None:
                    return [y.view(*x.shape[:-1], y.shape[-1]) for y in outs]
    return [module(x) for module in modules]


def _direct_product(cell: list, modules: tuple[nn.Module, ...], executor):
    """The executor's product bound to these layers' weights (`direct_product`: an
    in-process serving executor's), or None where it offers none. Kept in `cell` (a call
    site's) and made again when the executor, its few-rows kernel (a benchmark swaps it
    out) or any of the modules changes."""
    kept = cell[0]
    few_rows = getattr(executor, "few_rows", None)
    if (
        kept is None
        or kept[0] is not executor
        or kept[1] is not few_rows
        or kept[2] != modules  # a tuple of modules: compared by identity
    ):
        make = getattr(executor, "direct_product", None)
        layers = tuple(m.spec.id for m in modules)
        kept = cell[0] = (executor, few_rows, modules, None if make is None else make(layers))
    return kept[3]


def _bare(module: nn.Module, executor) -> bool:
    return isinstance(module, VirtLayer) and module._executor is executor and not _hooked(module)


def _mlp(layer: _Layer, x: torch.Tensor, direct: bool) -> torch.Tensor:
    """transformers' Llama MLP, `down(act(gate(x)) * up(x))`, with its projections through
    `_project` (gate and up as one call)."""
    mlp = layer.mlp
    if not direct or _hooked(mlp):
        return mlp(x)
    gate, up = _project((mlp.gate_proj, mlp.up_proj), x, direct, layer.products[2])
    return _project((mlp.down_proj,), mlp.act_fn(gate) * up, direct, layer.products[3])[0]


def _is_plain_layer(layer: nn.Module, classes: dict) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    return (
        type(layer) is classes["DecoderLayer"]
        and type(attn) is classes["Attention"]
        and type(mlp) is classes["MLP"]
        and type(layer.input_layernorm) is classes["RMSNorm"]
        and type(layer.post_attention_layernorm) is classes["RMSNorm"]
        and not hasattr(attn, "q_norm")
        and not hasattr(attn, "sinks")
    )


def _layer_of(layer: nn.Module, config) -> _Layer:
    attn = layer.self_attn
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if hasattr(attn, "sliding_window"):  # Qwen2: per layer type
        window = attn.sliding_window
    elif config.model_type == "mistral":  # Mistral: the config's, every layer
        window = getattr(config, "sliding_window", None)
    else:
        window = None
    return _Layer(
        attn=attn,
        input_norm=layer.input_layernorm,
        post_norm=layer.post_attention_layernorm,
        mlp=layer.mlp,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=attn.head_dim,
        scaling=attn.scaling,
        window=window,
    )


def _add_rms_norm(
    ops: LayerOps | None, norm: nn.Module, h: torch.Tensor, out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after adding a block's output to it (`out`; None: nothing to
    add), and its norm: ([1, n, hidden], [1, n, hidden])."""
    fused = ops is not None and not _hooked(norm) and LayerOps.norm_fits(h, norm.weight)
    if fused and (out is None or (LayerOps.fits(out) and out.shape == h.shape)):
        return ops.rms_norm(h, norm.weight, norm.variance_epsilon, out)
    if out is not None:
        h = h + out
    return h, _rms_norm(norm, h)


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm; in float32 as one fused call (bitwise equal), unless hooks
    (a served delta's, symbiont/serve/deltas.py) must see the module run."""
    if x.dtype != torch.float32 or norm.weight.dtype != torch.float32 or _hooked(norm):
        return norm(x)
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


def _hooked(module: nn.Module) -> bool:
    # (torch's module imported once at the top: an import statement here ran about 50
    # times per decode step)
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or _torch_module._global_forward_hooks
        or _torch_module._global_forward_pre_hooks
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
