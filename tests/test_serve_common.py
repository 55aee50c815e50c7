"""Shared helpers for the serving tests (no tests here): adapters saved as real PEFT
folders, and the vanilla transformers + peft reference each request must equal."""

from __future__ import annotations

from pathlib import Path

import peft
import torch
from transformers import AutoModelForCausalLM

from tests.tiny_models import ARCHS, VOCAB


def lora_config(arch: str, rank: int, **kw) -> peft.LoraConfig:
    targets = kw.pop("targets", "all-linear")
    return peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, task_type="CAUSAL_LM", **kw
    )


def ia3_config(arch: str) -> peft.IA3Config:
    a = ARCHS[arch]
    return peft.IA3Config(
        target_modules=list(a.attention + a.feedforward),
        feedforward_modules=list(a.feedforward),
        task_type="CAUSAL_LM",
    )


def save_adapter(base_path: Path, config, folder: Path, seed: int) -> Path:
    """A PEFT adapter with non-trivial random weights (LoRA B != 0, IA3 != 1), saved."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base_path), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * (0.3 if "ia3" in name else 0.2))
    model.save_pretrained(folder)
    return folder


def make_adapters(base_path: Path, folder: Path, arch: str = "llama") -> dict[str, Path]:
    """Adapters of mixed methods and ranks: name -> folder."""
    configs = {
        "lora4": lora_config(arch, 4),
        "lora8_attn": lora_config(arch, 8, targets=list(ARCHS[arch].attention)),
        "lora16": lora_config(arch, 16),
        "rslora2": lora_config(arch, 2, use_rslora=True),
        "ia3": ia3_config(arch),
        "ia3_b": ia3_config(arch),
    }
    return {
        name: save_adapter(base_path, config, folder / name, seed=10 + i)
        for i, (name, config) in enumerate(configs.items())
    }


def prompts(n: int, seed: int = 0, low: int = 2, high: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (length,), generator=g).tolist() for length in lengths]


class Reference:
    """Vanilla transformers + peft generate, one request at a time, cached per adapter."""

    def __init__(self, base_path: Path, adapters: dict[str, Path]):
        self.base_path = base_path
        self.adapters = adapters
        self._models: dict = {}

    def model(self, adapter: str | None):
        if adapter not in self._models:
            model = AutoModelForCausalLM.from_pretrained(self.base_path)
            if adapter is not None:
                model = peft.PeftModel.from_pretrained(model, self.adapters[adapter])
            self._models[adapter] = model.eval()
        return self._models[adapter]

    @torch.no_grad()
    def generate(self, prompt: list[int], adapter: str | None, max_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        out = self.model(adapter).generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        return out[0, len(prompt) :].tolist()

    @torch.no_grad()
    def logits(self, tokens: list[int], adapter: str | None) -> torch.Tensor:
        """[len(tokens), vocab] logits of one full sequence."""
        return self.model(adapter)(input_ids=torch.tensor([tokens])).logits[0]


CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def add_char_tokenizer(folder: Path) -> Path:
    """Save a character-level tokenizer (printable ASCII, ids below VOCAB) into `folder`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + [chr(c) for c in range(32, 127)])}
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return folder
