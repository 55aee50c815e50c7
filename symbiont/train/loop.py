"""The training loop behind `symbiont finetune`: AdamW, gradient accumulation, a learning
rate schedule, periodic eval loss, metrics as JSONL, atomic checkpoints and exact resume.

Exact resume rests on three things: the batch order is a pure function of (seed, epoch),
so micro-batch k is the same batch in every run; the optimizer, scheduler and torch RNG
(dropout) states are saved with each checkpoint; and the adapter weights are saved in
their own dtype. A resumed run therefore takes bit-for-bit the same steps.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
from transformers import get_scheduler

from symbiont.protocol.executor import ExecutorError
from symbiont.train.checkpoints import (
    TrainState,
    checkpoint_dir,
    latest_checkpoint,
    load_checkpoint,
    peft_conflicts,
    publish_adapter,
    remove_abandoned_staging,
    save_checkpoint,
)
from symbiont.train.config import TrainConfig
from symbiont.train.data import Example, collate

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "train_summary.json"  # the TrainResult of the last (part of a) run


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite: nothing is published."""


@dataclass(frozen=True)
class TrainResult:
    steps: int
    final_loss: float  # mean training loss of the last logged window
    eval_loss: float | None
    tokens: int  # non-padding training tokens processed in this process
    seconds: float  # in optimizer steps (evaluation, checkpoints and saving left out)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def batch_indices(config: TrainConfig, n_examples: int, micro_step: int) -> list[int]:
    """Example indices of global micro-batch `micro_step`: a seeded shuffle per epoch."""
    per_epoch = config.batches_per_epoch(n_examples)
    epoch, position = divmod(micro_step, per_epoch)
    generator = torch.Generator().manual_seed(config.seed * 100_003 + epoch)
    order = torch.randperm(n_examples, generator=generator)
    return order[position * config.batch_size : (position + 1) * config.batch_size].tolist()


def make_optimizer(model, config: TrainConfig):
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters; attach a PEFT adapter first")
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    return optimizer, params


def make_scheduler(optimizer, config: TrainConfig, total_steps: int):
    return get_scheduler(
        config.schedule,
        optimizer,
        num_warmup_steps=config.warmup_steps,
        num_training_steps=total_steps,
    )


def train(
    model,
    examples: Sequence[Example],
    config: TrainConfig,
    out: str | Path,
    *,
    pad_token_id: int,
    eval_examples: Sequence[Example] = (),
    resume: bool = False,
    progress: bool = True,
    on_step: Callable[[dict], None] | None = None,
) -> TrainResult:
    """Train the trainable parameters of `model` (a PEFT model) and write the adapter to `out`."""
    run = _Run(model, list(examples), list(eval_examples), config, Path(out), pad_token_id)
    run.start(resume)
    return run.loop(progress, on_step)


class _Run:
    """State of one training run; methods are the loop's steps."""

    def __init__(self, model, examples, eval_examples, config, out, pad_token_id):
        if not examples:
            raise ValueError("no training examples")
        self.model, self.examples, self.eval_examples = model, examples, eval_examples
        self.config, self.out, self.pad = config, out, pad_token_id
        self.total = config.total_steps(len(examples))
        self.optimizer, self.params = make_optimizer(model, config)
        self.scheduler = make_scheduler(self.optimizer, config, self.total)
        self.data = _fingerprint(examples)
        self.state = TrainState(step=0, tokens=0, config={**config.as_record(), "data": self.data})
        self.eval_loss: float | None = None
        self._updating = False  # inside an optimizer step's update (`_save_before_stopping`)

    def start(self, resume: bool) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        remove_abandoned_staging(self.out)
        checkpoint = latest_checkpoint(self.out) if resume else None
        if resume and checkpoint is None:
            log.info("--resume: no checkpoint in %s yet, starting from step 0", self.out)
        if checkpoint is not None:
            self._restore(checkpoint)
        else:
            torch.manual_seed(self.config.seed)
        _truncate_metrics(self.out / METRICS_FILE, self.state.step)

    def _restore(self, checkpoint: Path) -> None:
        # The adapter's settings first: with other target modules its tensors do not fit.
        conflicts = peft_conflicts(self.model, checkpoint)
        if not conflicts:
            saved = load_checkpoint(checkpoint, self.model, self.optimizer, self.scheduler)
            conflicts = self.config.resume_conflicts(saved.config)
            data = saved.config.get("data")  # checkpoints before session 11 have none
            if data is not None and data != self.data:
                conflicts.append(
                    f"training data: checkpoint {data['examples']} examples "
                    f"(sha256 {data['sha256']}), now {self.data['examples']} "
                    f"(sha256 {self.data['sha256']})"
                )
        if conflicts:
            raise ValueError(
                f"cannot resume from {checkpoint}: the training settings changed "
                f"({'; '.join(conflicts)}); rerun with the original settings or use a new --out"
            )
        self.state = saved
        log.info("resumed from %s (step %d of %d)", checkpoint, saved.step, self.total)

    def loop(self, progress: bool, on_step) -> TrainResult:
        bar = _progress_bar(self.total, self.state.step, progress)
        self.model.train()
        # tokens/s counts the optimizer steps' time only: evaluation, checkpoints and the
        # final save are not training throughput
        window_tokens, window_seconds, train_seconds, losses = 0, 0.0, 0.0, []
        tokens_here, last_loss = 0, float("nan")
        while self.state.step < self.total:
            started = time.perf_counter()
            rng = _rng_states()  # as a checkpoint at this step holds it
            try:
                loss, tokens = self._optimizer_step()
            except (KeyboardInterrupt, ExecutorError):
                bar.close()
                self._save_before_stopping(rng)
                raise
            seconds = time.perf_counter() - started
            step = self.state.step + 1
            if not math.isfinite(loss):
                raise TrainingDiverged(
                    f"step {step}: the training loss is {loss}; training diverged, so no "
                    f"adapter is published. Lower --lr or set --max-grad-norm, and start "
                    f"again (checkpoints in {self.out} hold the steps before it)"
                )
            self.state = TrainState(step, self.state.tokens + tokens, self.state.config)
            self._updating = False  # the weights and the step count agree again
            losses.append(loss)
            window_tokens += tokens
            tokens_here += tokens
            window_seconds += seconds
            train_seconds += seconds
            if step % self.config.log_every == 0 or step == self.total:
                last_loss = sum(losses) / len(losses)
                record = self._record(step, last_loss, window_tokens / max(window_seconds, 1e-9))
                self._maybe_eval(step, record)
                self._log(record, bar, on_step)
                window_tokens, window_seconds, losses = 0, 0.0, []
            self._maybe_save(step)
            bar.update(1)
        bar.close()
        publish_adapter(self.model, self.out)
        summary = self.out / SUMMARY_FILE
        if tokens_here == 0 and summary.is_file():  # --resume of a finished run: keep its
            return _read_summary(summary)  # summary, not one of no steps (a NaN loss)
        result = TrainResult(self.state.step, last_loss, self.eval_loss, tokens_here, train_seconds)
        _write_summary(summary, result)
        return result

    def _save_before_stopping(self, rng: tuple) -> None:
        """Ctrl-C or a lost executor in the middle of a step: save the run as it was
        after the last one (the weights and optimizer are untouched until the update, the
        RNG as it was before the step), so that --resume loses nothing, not everything
        since the last --save-every. Not if the update itself was cut (a step half
        applied): the newest checkpoint stands then."""
        step, done = self.state.step, latest_checkpoint(self.out)
        if step == 0 or (done is not None and done.name == checkpoint_dir(self.out, step).name):
            return
        if self._updating:
            log.warning("stopped during step %d's update; the newest checkpoint stands", step + 1)
            return
        _set_rng_states(rng)
        try:
            saved = save_checkpoint(
                self.model, self.optimizer, self.scheduler, self.state, self.out, 0
            )
        except Exception as err:  # noqa: BLE001 - the stop's own error is what to report
            log.error("stopped at step %d, and could not save it: %s", step, err)
            return
        log.info(
            "stopped after step %d of %d: saved in %s; run the same command with --resume "
            "to continue from there",
            step,
            self.total,
            saved,
        )

    def _optimizer_step(self) -> tuple[float, int]:
        """One optimizer step over grad_accum micro-batches; returns (mean loss, tokens)."""
        accum, total_loss, tokens = self.config.grad_accum, 0.0, 0
        for micro in range(accum):
            index = self.state.step * accum + micro
            batch = _on_model(self.model, collate(self._batch(index), self.pad))
            loss = self.model(**batch).loss  # batch: each [batch, longest]
            (loss / accum).backward()
            total_loss += loss.item()
            tokens += int(batch["attention_mask"].sum())
        self._updating = True  # from here on, the weights change
        if self.config.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total_loss / accum, tokens  # (`loop` ends `_updating` once the step counts)

    def _batch(self, micro_step: int) -> list[Example]:
        indices = batch_indices(self.config, len(self.examples), micro_step)
        return [self.examples[i] for i in indices]

    def _record(self, step: int, loss: float, tokens_per_s: float) -> dict:
        per_epoch = self.config.batches_per_epoch(len(self.examples))
        return {
            "step": step,
            "epoch": round(step * self.config.grad_accum / per_epoch, 4),
            "loss": round(loss, 6),
            "lr": self.scheduler.get_last_lr()[0],
            "tokens": self.state.tokens,
            "tokens_per_s": round(tokens_per_s, 1),
        }

    def _maybe_eval(self, step: int, record: dict) -> None:
        every = self.config.eval_every
        if self.eval_examples and ((every and step % every == 0) or step == self.total):
            self.eval_loss = evaluate(self.model, self.eval_examples, self.config, self.pad)
            record["eval_loss"] = round(self.eval_loss, 6)

    def _log(self, record: dict, bar, on_step) -> None:
        with open(self.out / METRICS_FILE, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        postfix = {"loss": f"{record['loss']:.4f}", "tok/s": f"{record['tokens_per_s']:.0f}"}
        if "eval_loss" in record:
            postfix["eval"] = f"{record['eval_loss']:.4f}"
        bar.set_postfix(postfix, refresh=False)
        if on_step is not None:
            on_step(record)

    def _maybe_save(self, step: int) -> None:
        every = self.config.save_every
        if (every and step % every == 0) or step == self.total:
            save_checkpoint(
                self.model,
                self.optimizer,
                self.scheduler,
                self.state,
                self.out,
                self.config.save_total_limit,
            )


def _rng_states() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_states(states: tuple) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _on_model(model, batch: dict) -> dict:
    """The batch's tensors on the model's device (its input embeddings')."""
    device = model.get_input_embeddings().weight.device
    if device.type == "cpu":
        return batch
    return {name: tensor.to(device) for name, tensor in batch.items()}


def evaluate(model, examples: Sequence[Example], config: TrainConfig, pad_token_id: int) -> float:
    """Mean loss per predicted token over `examples`, in eval mode and without gradients."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(examples), config.batch_size):
            batch = _on_model(
                model, collate(examples[start : start + config.batch_size], pad_token_id)
            )
            n = int((batch["labels"][:, 1:] != -100).sum())  # tokens the loss averages over
            total += model(**batch).loss.item() * n
            count += n
    model.train(was_training)
    return total / max(count, 1)


def _write_summary(path: Path, result: TrainResult) -> None:
    record = {**asdict(result), "tokens_per_s": round(result.tokens_per_s, 1)}
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def _read_summary(path: Path) -> TrainResult:
    record = json.loads(path.read_text(encoding="utf-8"))
    return TrainResult(*(record[f.name] for f in fields(TrainResult)))


def _fingerprint(examples: Sequence[Example]) -> dict:
    """What a resume must train on again: the examples' tokens and labels, hashed."""
    digest = hashlib.sha256()
    for example in examples:
        for values in (example.input_ids, example.labels):
            digest.update(len(values).to_bytes(4, "little"))
            digest.update(np.asarray(values, dtype=np.int64).tobytes())
    return {"examples": len(examples), "sha256": digest.hexdigest()[:16]}


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records past `step` (written by a run killed after its last checkpoint)."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    kept = [line for line in lines if (n := _record_step(line)) is not None and n <= step]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def _record_step(line: str) -> int | None:
    """A metrics line's step; None for a line torn by a kill mid-write (dropped)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else None


def _progress_bar(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True)
