"""transformers.Trainer runs on a split client unchanged and trains exactly like vanilla."""

from __future__ import annotations

import peft
import torch
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import symbiont
from tests.tiny_models import VOCAB


class _Tokens(Dataset):
    def __init__(self, rows=8, length=12):
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, VOCAB, (rows, length), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def _train(model, folder) -> list[float]:
    args = TrainingArguments(
        output_dir=str(folder),
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens())
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_losses_and_adapter_match_vanilla(checkpoints, tmp_path):
    path = checkpoints("llama")
    config = peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    torch.manual_seed(0)
    vanilla = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path), config)
    torch.manual_seed(0)
    split = peft.get_peft_model(
        symbiont.load_client(path, symbiont.BaseExecutor.from_pretrained(path)), config
    )
    losses_vanilla = _train(vanilla, tmp_path / "vanilla")
    losses_split = _train(split, tmp_path / "split")
    assert len(losses_split) == 4 and losses_split == losses_vanilla
    trained_vanilla = peft.get_peft_model_state_dict(vanilla)
    trained_split = peft.get_peft_model_state_dict(split)
    assert trained_vanilla.keys() == trained_split.keys()
    for name, tensor in trained_vanilla.items():
        assert torch.equal(trained_split[name], tensor), name
