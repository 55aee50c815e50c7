"""Small random models of many architectures, saved as real local checkpoints."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 128

# Dropout off everywhere so train/eval modes agree and results are deterministic.
_COMMON = dict(vocab_size=VOCAB, tie_word_embeddings=False)


@dataclass(frozen=True)
class Arch:
    name: str
    model_type: str
    config: dict
    attention: tuple[str, ...]  # module names LoRA targets for "attention only"
    feedforward: tuple[str, ...]  # MLP module names (IA3 scales their input)
    extra: dict = field(default_factory=dict)


_DECODER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    **_COMMON,
)
_LLAMA_MLP = ("gate_proj", "up_proj", "down_proj")

ARCHS = {
    a.name: a
    for a in [
        Arch("llama", "llama", _DECODER, ("q_proj", "v_proj"), _LLAMA_MLP),
        Arch("qwen2", "qwen2", _DECODER, ("q_proj", "v_proj"), _LLAMA_MLP),
        Arch("mistral", "mistral", _DECODER, ("q_proj", "v_proj"), _LLAMA_MLP),
        Arch(
            "gemma2",
            "gemma2",
            {**_DECODER, "head_dim": 8, "tie_word_embeddings": True, "query_pre_attn_scalar": 8},
            ("q_proj", "v_proj"),
            _LLAMA_MLP,
        ),
        Arch(
            "gemma3",
            "gemma3_text",
            {**_DECODER, "head_dim": 8, "tie_word_embeddings": True, "query_pre_attn_scalar": 8},
            ("q_proj", "v_proj"),
            _LLAMA_MLP,
        ),
        Arch(
            "phi3",
            "phi3",
            {**_DECODER, "pad_token_id": 0},
            ("qkv_proj",),
            ("gate_up_proj", "down_proj"),
        ),
        Arch(
            "gpt2",
            "gpt2",
            dict(
                n_embd=32,
                n_layer=2,
                n_head=4,
                n_positions=128,
                vocab_size=VOCAB,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            ),
            ("c_attn",),
            ("c_fc", "mlp.c_proj"),
        ),
        Arch(
            "gpt_bigcode",
            "gpt_bigcode",
            dict(
                n_embd=32,
                n_layer=2,
                n_head=4,
                n_positions=128,
                vocab_size=VOCAB,
                multi_query=True,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            ),
            ("c_attn",),
            ("c_fc", "mlp.c_proj"),
        ),
        Arch(
            "opt",
            "opt",
            dict(
                hidden_size=32,
                ffn_dim=64,
                word_embed_proj_dim=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=128,
                vocab_size=VOCAB,
                dropout=0.0,
                attention_dropout=0.0,
                activation_dropout=0.0,
            ),
            ("q_proj", "v_proj"),
            ("fc1", "fc2"),
        ),
        # transformers renames keys on load: GPT-NeoX saves `lm_head` as `embed_out`.
        Arch(
            "gpt_neox",
            "gpt_neox",
            dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=128,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                **_COMMON,
            ),
            ("query_key_value",),
            ("dense_h_to_4h", "dense_4h_to_h"),
        ),
    ]
}


# Families tested by tests/test_families.py only (LoRA on all linear layers), kept out of
# ARCHS so the method x transport matrix of tests/test_exactness.py does not grow.
FAMILY_ARCHS = {
    a.name: a
    for a in [
        Arch("qwen3", "qwen3", {**_DECODER, "head_dim": 8}, ("q_proj", "v_proj"), _LLAMA_MLP),
        Arch(
            "qwen3_bias",
            "qwen3",
            {**_DECODER, "head_dim": 8, "attention_bias": True},
            ("q_proj", "v_proj"),
            _LLAMA_MLP,
        ),
        Arch(
            "falcon",
            "falcon",
            dict(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                bias=True,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                **_COMMON,
            ),
            ("query_key_value",),
            ("dense_h_to_4h", "dense_4h_to_h"),
        ),
    ]
}
# Mixture-of-experts families (tests/test_moe.py): the experts run on the executor as one
# op whose CPU grouped matmul sums in an order that depends on the thread count, so they are
# compared within a tolerance, out of the bitwise matrix of tests/test_exactness.py. Each
# save_pretrained writes the experts as transformers' conversion mapping expects: one
# tensor per expert (Mixtral, Qwen3-MoE, OLMoE) or legacy fused names (GraniteMoe).
_MOE = {**_DECODER, "num_experts_per_tok": 2}
MOE_ARCHS = {
    a.name: a
    for a in [
        Arch("mixtral", "mixtral", {**_MOE, "num_local_experts": 4}, ("q_proj", "v_proj"), ()),
        Arch(
            "qwen3_moe",
            "qwen3_moe",
            {**_MOE, "num_experts": 4, "moe_intermediate_size": 16, "head_dim": 8},
            ("q_proj", "v_proj"),
            (),
        ),
        Arch("olmoe", "olmoe", {**_MOE, "num_experts": 4}, ("q_proj", "v_proj"), ()),
        Arch(  # shared experts: linear base layers beside the routed ones
            "qwen2_moe",
            "qwen2_moe",
            {
                **_MOE,
                "num_experts": 4,
                "moe_intermediate_size": 16,
                "shared_expert_intermediate_size": 32,
            },
            ("q_proj", "v_proj"),
            (),
        ),
        Arch(
            "granitemoe", "granitemoe", {**_MOE, "num_local_experts": 4}, ("q_proj", "v_proj"), ()
        ),
    ]
}
ALL_ARCHS = ARCHS | FAMILY_ARCHS | MOE_ARCHS

# A one-layer Llama whose layers are under the serving executor's MIN_PACKED_WEIGHTS but
# not tiny (hidden 256: q/k/v 131K weights, o 65K, gate/up 360K, down 180K): small
# modules keep their plain weights beside a packed copy (symbiont/base/prepack.py), and
# products of 64 rows pass serve-base --matmul onednn's ONEDNN_MIN_MACS
WIDE_LLAMA = dataclasses.replace(
    ARCHS["llama"],
    config={
        **ARCHS["llama"].config,
        "hidden_size": 256,
        "intermediate_size": 704,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
)


def build_checkpoint(arch: Arch, folder: Path, *, seed: int = 0, dtype=torch.float32) -> Path:
    """Random weights from a seeded config, saved with save_pretrained as safetensors."""
    config = AutoConfig.for_model(arch.model_type, **arch.config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # non-trivial norms and biases so a wrong load shows up
        for name, param in model.named_parameters():
            if "norm" in name or "ln" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return folder
