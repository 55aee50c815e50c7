"""TRL's SFTTrainer runs on a split client and trains exactly like vanilla."""

from __future__ import annotations

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import symbiont
from symbiont.client.virt import BaseWeightUnavailable

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")


def _sft(model, tokenizer, folder) -> list[float]:
    texts = [f"Q: What is {a} plus {b}?\nA: {a + b}" for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
    config = trl.SFTConfig(
        output_dir=str(folder),
        per_device_train_batch_size=2,
        max_steps=3,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=True,
        dataloader_num_workers=0,
        max_length=64,
        # SFTConfig defaults to bf16 autocast; base layers run in the executor's dtype
        # instead (docs/compatibility.md), so compare in fp32 where results are exact.
        bf16=False,
    )
    trainer = trl.SFTTrainer(
        model=model,
        args=config,
        train_dataset=datasets.Dataset.from_dict({"text": texts}),
        processing_class=tokenizer,
    )
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_sft_trainer_losses_match_vanilla(model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    torch.manual_seed(0)
    vanilla = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config)
    torch.manual_seed(0)
    executor = symbiont.BaseExecutor.from_pretrained(model_dir)
    # TRL computes the SFT loss with a fused, chunked LM head that reads lm_head.weight.
    client = symbiont.load_client(model_dir, executor, local_lm_head=True)
    split = peft.get_peft_model(client, config)
    losses_vanilla = _sft(vanilla, tokenizer, tmp_path / "vanilla")
    losses_split = _sft(split, tokenizer, tmp_path / "split")
    assert len(losses_split) == 3 and losses_split == losses_vanilla


def test_sft_trainer_without_local_lm_head_says_what_to_do(model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    executor = symbiont.BaseExecutor.from_pretrained(model_dir)
    split = peft.get_peft_model(
        symbiont.load_client(model_dir, executor), peft.LoraConfig(target_modules="all-linear")
    )
    with pytest.raises(BaseWeightUnavailable, match="local_lm_head=True"):
        _sft(split, tokenizer, tmp_path)
