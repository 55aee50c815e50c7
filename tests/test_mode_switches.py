"""One client model used as a user does between evaluation and training: a forward under
`torch.inference_mode()`, then optimizer steps, then greedy generation under `no_grad`,
then inference mode again, over every transport. Each stage equals vanilla transformers
+ peft doing the same, bitwise.

Tensors made under inference mode are of another kind (no version counter, no in-place
edits outside the mode); an executor link that cached one of them from an evaluation
broke the next training step (shared-memory segment views did, see
`test_one_connection_serves_calls_in_and_out_of_inference_mode`).
"""

from __future__ import annotations

import peft
import torch

from tests.test_exactness import batch, make_pair


def _optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def test_evaluate_train_generate_evaluate_equals_vanilla(checkpoints, connect):
    path = checkpoints("llama")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    vanilla, split = make_pair(path, connect(path), config)
    models = {"vanilla": vanilla, "split": split}
    optimizers = {name: _optimizer(model) for name, model in models.items()}
    inputs = batch(rows=2, length=7)

    def evaluate():
        with torch.inference_mode():
            return {name: m.eval()(**inputs).logits for name, m in models.items()}

    def train_step():
        losses = {}
        for name, model in models.items():
            loss = model.train()(**inputs, labels=inputs["input_ids"]).loss
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad()
            losses[name] = loss.detach()
        return losses

    for stage in range(2):
        logits = evaluate()
        assert torch.equal(logits["split"], logits["vanilla"]), f"evaluation {stage}"
        for step in range(2):
            losses = train_step()
            assert torch.equal(losses["split"], losses["vanilla"]), f"stage {stage} step {step}"
        with torch.no_grad():
            gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
            tokens = {
                n: m.eval().generate(**batch(seed=3, rows=1), **gen) for n, m in models.items()
            }
        assert torch.equal(tokens["split"], tokens["vanilla"]), f"generation {stage}"
