"""The training loop: exact resume, atomic checkpoints, adapters vanilla peft reproduces,
and transformers.Trainer running on a client unchanged."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import symbiont
from symbiont.model.default import default_dataset
from symbiont.protocol.executor import ExecutorUnavailable
from symbiont.tenant import load_tokenizer
from symbiont.train import (
    AdapterFlags,
    TrainConfig,
    build_peft_config,
    latest_checkpoint,
    list_checkpoints,
    load_examples,
    load_peft_config,
    pad_id,
    train,
)
from symbiont.train import checkpoints as ckpt

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def executor(model_dir):
    return symbiont.BaseExecutor.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def examples(model_dir):
    return load_examples(default_dataset(), load_tokenizer(model_dir), max_length=64)[:24]


# LoRA dropout on, so resume must also restore the RNG to be exact.
SPEC = AdapterFlags(method="lora", r=4, dropout=0.1, target="all-linear")
CONFIG = TrainConfig(max_steps=6, batch_size=2, grad_accum=2, lr=1e-3, save_every=2, seed=3)


def client(model_dir, executor, spec=SPEC, seed=0):
    torch.manual_seed(seed)
    return peft.get_peft_model(symbiont.load_client(model_dir, executor), build_peft_config(spec))


def run(model, examples, out, config=CONFIG, **kw):
    return train(model, examples, config, out, pad_token_id=0, progress=False, **kw)


def adapter_tensors(folder):
    return load_file(str(folder / "adapter_model.safetensors"))


class Interrupt(Exception):
    pass


def interrupt_at(step):
    def on_step(record):
        if record["step"] == step:
            raise Interrupt

    return on_step


def test_resume_gives_the_same_adapter_as_an_uninterrupted_run(
    model_dir, executor, examples, tmp_path
):
    full = run(client(model_dir, executor), examples, tmp_path / "full")

    with pytest.raises(Interrupt):  # killed during step 5, after checkpoint-4
        run(client(model_dir, executor), examples, tmp_path / "cut", on_step=interrupt_at(5))
    assert latest_checkpoint(tmp_path / "cut").name == "checkpoint-000004"
    # A different init proves the weights come from the checkpoint, not from seeding.
    resumed = run(client(model_dir, executor, seed=99), examples, tmp_path / "cut", resume=True)

    assert resumed.steps == full.steps == 6
    want, got = adapter_tensors(tmp_path / "full"), adapter_tensors(tmp_path / "cut")
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), f"{name} differs after resume"
    steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2, 3, 4, 5, 6], "metrics must not repeat or skip steps across a resume"


@pytest.mark.parametrize("stop", [KeyboardInterrupt, ExecutorUnavailable])
def test_a_step_cut_by_ctrl_c_or_a_lost_executor_saves_the_run_before_it(
    model_dir, executor, examples, tmp_path, stop, caplog
):
    """Ctrl-C, or a serve-base gone, in the middle of a step lost every step since the
    last --save-every (all of them with the default 0). The run is now saved as it was
    after the last whole step (RNG included), and resuming it is exact."""
    full = run(client(model_dir, executor), examples, tmp_path / "full")
    model = client(model_dir, executor)
    calls = []

    def cut_in_step_4(*_):  # micro-batches 6 and 7 make step 4: stop in the second
        calls.append(1)
        if len(calls) == 8:
            raise stop("cut")

    model.register_forward_pre_hook(cut_in_step_4)
    with caplog.at_level("INFO", logger="symbiont.train.loop"), pytest.raises(stop):
        run(model, examples, tmp_path / "cut")
    assert latest_checkpoint(tmp_path / "cut").name == "checkpoint-000003"
    assert "stopped after step 3 of 6" in caplog.text and "--resume" in caplog.text
    run(client(model_dir, executor, seed=99), examples, tmp_path / "cut", resume=True)
    want, got = adapter_tensors(tmp_path / "full"), adapter_tensors(tmp_path / "cut")
    for name in want:
        assert torch.equal(want[name], got[name]), f"{name} differs after resume"
    assert full.steps == 6


def test_resume_refuses_changed_settings(model_dir, executor, examples, tmp_path):
    run(client(model_dir, executor), examples, tmp_path, config=TrainConfig(max_steps=2))
    with pytest.raises(ValueError, match=r"lr: checkpoint 0.0002, now 0.1"):
        run(
            client(model_dir, executor),
            examples,
            tmp_path,
            config=TrainConfig(max_steps=4, lr=0.1),
            resume=True,
        )


def test_resume_refuses_changed_training_data(model_dir, executor, examples, tmp_path):
    """--resume with another --data file trained on it from the checkpoint on, silently."""
    config = TrainConfig(max_steps=4, save_every=2)
    with pytest.raises(Interrupt):
        run(client(model_dir, executor), examples, tmp_path, config=config, on_step=interrupt_at(3))
    fewer = examples[:-1]
    with pytest.raises(ValueError, match=r"training data: checkpoint \d+ examples .*now \d+"):
        run(client(model_dir, executor), fewer, tmp_path, config=config, resume=True)
    result = run(client(model_dir, executor), examples, tmp_path, config=config, resume=True)
    assert result.steps == 4, "the same data resumes"


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        (AdapterFlags(method="lora", r=4, dropout=0.1, target="all-linear", alpha=64), "lora_alpha"),
        (AdapterFlags(method="lora", r=4, dropout=0.5, target="all-linear"), "lora_dropout: checkpoint 0.1, now 0.5"),
        (AdapterFlags(method="lora", r=4, dropout=0.1, target="q_proj,v_proj"), "target_modules"),
    ],
)  # fmt: skip
def test_resume_refuses_changed_adapter_settings(
    model_dir, executor, examples, tmp_path, changed, message
):
    """The adapter's own settings change the result as much as the optimizer's do: a
    resume with another alpha or dropout trained a different adapter without a word."""
    config = TrainConfig(max_steps=2, save_every=2)
    run(client(model_dir, executor), examples, tmp_path, config=config)
    with pytest.raises(ValueError, match=rf"training settings changed \(.*{message}"):
        run(
            client(model_dir, executor, spec=changed),
            examples,
            tmp_path,
            config=config,
            resume=True,
        )
    same = run(client(model_dir, executor), examples, tmp_path, config=config, resume=True)
    assert same.steps == 2  # the original settings still resume


def test_resuming_a_finished_run_keeps_its_summary(model_dir, executor, examples, tmp_path):
    """Nothing left to train: the summary of the run stays (it was rewritten with no steps'
    loss, NaN), and the adapter is the same."""
    config = TrainConfig(max_steps=2, save_every=2)
    first = run(client(model_dir, executor), examples, tmp_path, config=config)
    summary = (tmp_path / "train_summary.json").read_text()
    adapter = adapter_tensors(tmp_path)
    again = run(client(model_dir, executor), examples, tmp_path, config=config, resume=True)
    assert (tmp_path / "train_summary.json").read_text() == summary
    assert again.final_loss == first.final_loss and again.steps == 2
    assert all(torch.equal(adapter[k], v) for k, v in adapter_tensors(tmp_path).items())


def test_a_diverged_loss_stops_the_run_and_publishes_nothing(
    model_dir, executor, examples, tmp_path, monkeypatch
):
    """A NaN loss used to train on and publish a NaN adapter with exit code 0."""
    from symbiont.train import loop

    step = loop._Run._optimizer_step
    calls = []

    def diverging(self):
        loss, tokens = step(self)
        calls.append(loss)
        return (float("nan") if len(calls) == 3 else loss), tokens

    monkeypatch.setattr(loop._Run, "_optimizer_step", diverging)
    config = TrainConfig(max_steps=4, save_every=2)
    with pytest.raises(loop.TrainingDiverged, match="step 3: the training loss is nan"):
        run(client(model_dir, executor), examples, tmp_path, config=config)
    assert not (tmp_path / "adapter_model.safetensors").exists(), "nothing published"
    assert (tmp_path / "checkpoint-000002").is_dir(), "the steps before it are kept"


def test_resume_after_a_kill_mid_metrics_line(model_dir, executor, examples, tmp_path):
    """A kill while a metrics record was written left a torn last line, and every
    --resume failed on it with a bare JSON error."""
    config = TrainConfig(max_steps=4, save_every=2)
    with pytest.raises(Interrupt):
        run(client(model_dir, executor), examples, tmp_path, config=config, on_step=interrupt_at(3))
    metrics = tmp_path / "metrics.jsonl"
    with open(metrics, "a", encoding="utf-8") as handle:
        handle.write('{"step": 4, "loss": 1.2')  # torn by the kill
    result = run(client(model_dir, executor), examples, tmp_path, config=config, resume=True)
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert result.steps == 4 and steps == [1, 2, 3, 4]


class _Planted:
    """Unpickling this runs code: it writes a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pwned"))


def test_resume_never_unpickles_what_the_run_folder_holds(model_dir, executor, examples, tmp_path):
    out, config = tmp_path / "run", TrainConfig(max_steps=4, save_every=2)
    with pytest.raises(Interrupt):
        run(client(model_dir, executor), examples, out, config, on_step=interrupt_at(3))
    checkpoint = latest_checkpoint(out)
    assert {p.name for p in checkpoint.glob("*.pt")} <= {"optimizer.pt", "rng.pt"}, (
        "non-tensor state must be JSON"
    )
    assert json.loads((checkpoint / "scheduler.json").read_text())["last_epoch"] == 2
    marker = tmp_path / "marker"
    planted = {  # a planted legacy scheduler file, a planted tensor file
        "scheduler.pt": "does not unpickle them",
        "optimizer.pt": "Weights only load failed",
    }
    for name, message in planted.items():
        (checkpoint / "scheduler.json").unlink(missing_ok=True)
        torch.save(_Planted(marker), checkpoint / name)
        with pytest.raises((ValueError, pickle.UnpicklingError), match=message):
            run(client(model_dir, executor), examples, out, config, resume=True)
        assert not marker.exists(), f"resume ran code planted in {name}"


def test_a_failed_checkpoint_write_leaves_no_partial_checkpoint(
    model_dir, executor, examples, tmp_path, monkeypatch
):
    run(client(model_dir, executor), examples, tmp_path, config=TrainConfig(max_steps=2))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-000002"]

    def dies_midway(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", dies_midway)  # adapter written, optimizer not
    model = client(model_dir, executor)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(model, optimizer, None, ckpt.TrainState(3, 0, {}), tmp_path, keep=2)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint")] == [
        "checkpoint-000002"
    ], "a failed write must leave no checkpoint folder behind"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(ckpt.STAGING_PREFIX)]


def test_abandoned_staging_folder_is_ignored_and_removed(model_dir, executor, examples, tmp_path):
    staging = tmp_path / f"{ckpt.STAGING_PREFIX}killed"
    (staging / "half").mkdir(parents=True)
    (tmp_path / "checkpoint-000009").mkdir()  # no trainer_state.json: incomplete
    assert latest_checkpoint(tmp_path) is None
    run(client(model_dir, executor), examples, tmp_path, config=TrainConfig(max_steps=1))
    assert not staging.exists()


def test_saved_adapter_reproduces_outputs_in_vanilla_peft(model_dir, executor, examples, tmp_path):
    model = client(model_dir, executor)
    run(model, examples, tmp_path, config=TrainConfig(max_steps=3, lr=1e-2))
    assert (tmp_path / "adapter_config.json").is_file()
    vanilla = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir), tmp_path
    ).eval()
    ids = torch.tensor([list(examples[0].input_ids)])
    with torch.no_grad():
        assert torch.equal(vanilla(input_ids=ids).logits, model.eval()(input_ids=ids).logits)


@pytest.mark.parametrize("method", ["ia3", "prefix"])
def test_other_methods_train_and_lower_the_loss(model_dir, executor, examples, tmp_path, method):
    model = client(model_dir, executor, AdapterFlags(method=method, virtual_tokens=4))
    config = TrainConfig(max_steps=8, lr=3e-2, batch_size=4, schedule="constant", log_every=4)
    records = []
    run(model, examples, tmp_path, config=config, on_step=records.append)
    assert records[-1]["loss"] < records[0]["loss"], records


def test_peft_config_from_json_file(tmp_path):
    peft.LoraConfig(r=3, target_modules=["q_proj"]).save_pretrained(tmp_path)
    config = load_peft_config(tmp_path / "adapter_config.json")
    assert isinstance(config, peft.LoraConfig) and config.r == 3
    (tmp_path / "bad.json").write_text('{"r": 3}')
    with pytest.raises(ValueError, match="peft_type"):
        load_peft_config(tmp_path / "bad.json")


def test_a_saved_adapters_config_trains_a_new_adapter(tmp_path):
    """A saved adapter's config says inference_mode: true, which froze every parameter of
    the new adapter ("the model has no trainable parameters")."""
    config = peft.LoraConfig(r=3, target_modules=["q_proj"], inference_mode=True)
    config.save_pretrained(tmp_path)
    loaded = load_peft_config(tmp_path)
    assert loaded.inference_mode is False and loaded.r == 3
    assert load_peft_config(tmp_path) is not loaded  # a copy: nothing shared is changed


def test_checkpoints_are_ordered_by_step_past_six_digits(tmp_path):
    for step in (900_000, 1_000_000, 1_100_000):
        folder = ckpt.checkpoint_dir(tmp_path, step)
        folder.mkdir()
        (folder / ckpt.STATE_FILE).write_text("{}")
    (tmp_path / "checkpoint-x").mkdir()  # not a step: ignored
    steps = [p.name for p in ckpt.list_checkpoints(tmp_path)]
    assert steps == ["checkpoint-900000", "checkpoint-1000000", "checkpoint-1100000"]
    assert ckpt.latest_checkpoint(tmp_path).name == "checkpoint-1100000"


def test_transformers_trainer_runs_on_a_client_unchanged(model_dir, executor, examples, tmp_path):
    from transformers import Trainer, TrainingArguments

    from symbiont.train import collate

    model = client(model_dir, executor, AdapterFlags(method="lora", r=4))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=list(examples),
        data_collator=lambda rows: collate(rows, 0),
    )
    trainer.train()
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not p.equal(before[n])]
    assert changed, "Trainer did not update the adapter"


def test_grad_accum_equals_a_bigger_batch_of_equal_length_rows(model_dir, executor, tmp_path):
    # Equal-length rows, so averaging per micro-batch equals averaging over the whole batch.
    from symbiont.train import Example

    rows = [Example(tuple(range(5 + i, 13 + i)), tuple(range(5 + i, 13 + i))) for i in range(4)]
    one = client(model_dir, executor, AdapterFlags(r=4))
    two = client(model_dir, executor, AdapterFlags(r=4))
    run(one, rows, tmp_path / "a", config=TrainConfig(max_steps=1, batch_size=4, lr=1e-2))
    run(two, rows, tmp_path / "b", config=TrainConfig(max_steps=1, batch_size=2, grad_accum=2, lr=1e-2))  # fmt: skip
    a, b = adapter_tensors(tmp_path / "a"), adapter_tensors(tmp_path / "b")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6)


def test_pad_id_falls_back_to_eos(model_dir):
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer.pad_token_id is not None, "the default tokenizer has its own pad token"
    assert pad_id(tokenizer) == tokenizer.pad_token_id
    tokenizer.pad_token = None  # a checkpoint without a pad token: batches pad with EOS
    assert tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None
    assert pad_id(tokenizer) == tokenizer.eos_token_id
    tokenizer.eos_token = None  # neither: token 0 (labels mask the padding anyway)
    assert pad_id(tokenizer) == 0


def test_epochs_that_grad_accum_does_not_divide_are_refused():
    """4 micro-batches an epoch with --grad-accum 3 trained 0.75 epoch for --epochs 1."""
    config = TrainConfig(epochs=1, batch_size=2, grad_accum=3)
    with pytest.raises(ValueError, match="--grad-accum 3 does not divide; pick .* dividing 4"):
        config.total_steps(8)
    assert TrainConfig(epochs=3, batch_size=2, grad_accum=3).total_steps(8) == 4
    assert TrainConfig(epochs=1, batch_size=2, grad_accum=3, max_steps=5).total_steps(8) == 5
