"""`symbiont demo`: fine-tune a LoRA adapter on the default model through a base executor,
print the falling loss, then generate with the adapter."""

from __future__ import annotations

import json
import random
import time

import torch

HELP = "fine-tune a LoRA adapter on the embedded default model through an executor, then generate"


def register(subparsers) -> None:
    parser = subparsers.add_parser("demo", help=HELP, description=HELP)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    parser.add_argument("--batch-size", type=int, default=8, help="examples per step (default 8)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seed for data order and adapter init")
    parser.set_defaults(func=run)


def run(args) -> int:
    import peft
    from transformers import AutoTokenizer

    import symbiont
    from symbiont.default_model import default_dataset

    torch.manual_seed(args.seed)
    path = symbiont.default_model()
    executor = symbiont.BaseExecutor.from_pretrained(path)
    print(
        f"base executor: {len(executor.manifest.layers)} frozen linear layers, "
        f"{executor.weight_bytes() / 2**20:.1f} MiB, loaded once"
    )
    model = symbiont.load_client(path, executor)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    records = [json.loads(line) for line in default_dataset().read_text().splitlines() if line]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    rng = random.Random(args.seed)
    model.train()
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = _completion_batch(tokenizer, rng.sample(records, args.batch_size))
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1 or step % 5 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}  ({time.perf_counter() - start:.1f}s)")
    model.eval()
    for record in records[:3]:
        inputs = tokenizer(record["prompt"], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(
                **inputs, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        print(f"{record['prompt']!r} -> {answer!r} (expected {record['completion']!r})")
    return 0


def _completion_batch(tokenizer, records) -> dict[str, torch.Tensor]:
    """Right-padded batch; loss only on completion tokens (prompt and padding are -100)."""
    rows = []
    for record in records:
        prompt = tokenizer(record["prompt"])["input_ids"]
        completion = tokenizer(record["completion"] + tokenizer.eos_token)["input_ids"]
        rows.append((prompt + completion, [-100] * len(prompt) + completion))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r[0] + [pad] * (width - len(r[0])) for r in rows])
    labels = torch.tensor([r[1] + [-100] * (width - len(r[1])) for r in rows])
    mask = torch.tensor([[1] * len(r[0]) + [0] * (width - len(r[0])) for r in rows])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
