"""Co-serving (symbiont/jobs/coserve.py): the cost model's budget, the hand-off of
fine-tuning windows into engine iterations, and training in those windows giving the
plain loop's adapter. Costs are fixed cost models here (no refit), so every budget the
tests check is a pure function of the load, never of timings."""

from __future__ import annotations

import dataclasses
import random
import shutil
import threading
import time

import openai
import peft
import pytest
import torch
from safetensors.torch import load_file

from symbiont import BaseExecutor, load_client
from symbiont.jobs.coserve import (
    BACKWARD_HEADROOM,
    FEATURES,
    CoServe,
    CostModel,
    _Need,
    plan_positions,
    train_coserved,
)
from symbiont.jobs.priority import PriorityGate, TrainingExecutor, give_inference_priority
from symbiont.jobs.store import ACTIVE
from symbiont.jobs.windows import IGNORE_INDEX, WindowedStep
from symbiont.protocol.executor import Executor
from symbiont.serve import EngineConfig
from symbiont.serve.config import ServerConfig
from symbiont.serve.engine import Engine
from symbiont.serve.http.server import BackgroundServer
from symbiont.train.config import TrainConfig
from symbiont.train.data import Example
from symbiont.train.loop import train
from tests.tiny_models import VOCAB

# seconds: per iteration, per inference token, per forward slot, per forward token,
# per backward slot, per backward token
COSTS = [1e-3, 1e-4, 1e-3, 1e-4, 1e-3, 2e-4]
SLO = 5e-3  # room after c=1: 3.9 ms, c=20: 2 ms, c=40: none


def fixed_costs() -> CostModel:
    return CostModel(COSTS, refit_every=0)


# -- the cost model --------------------------------------------------------------------


def test_a_fitted_model_picks_the_largest_budget_within_the_slo():
    truth = [2e-3, 5e-5, 1.5e-3, 8e-5, 2e-3, 1.7e-4]
    cost = CostModel(refit_every=0)
    rng = random.Random(0)
    model = CostModel(truth)
    for _ in range(60):  # iterations' inference parts and slots, measured apart
        c, s = rng.randrange(1, 200), rng.randrange(1, 300)
        cost.add(c, 0, 0, model.predict(c))
        forward, backward = (s, 0) if rng.random() < 0.5 else (0, s)
        cost.add(0, forward, backward, model.predict(0, forward, backward) - model.predict(0))
    cost.refit()
    assert cost.coefficients == pytest.approx(truth, rel=1e-6)
    slo = 0.02
    for c in (0, 1, 17, 100, 300, 400):
        for backward in (False, True):
            s = cost.budget(c, slo, backward, limit=10_000)

            def f(n, backward=backward, c=c):
                return cost.predict(c, 0, n) if backward else cost.predict(c, n, 0)

            if s > 0:
                assert f(s) <= slo
            assert f(s + 1) > slo, f"c={c}: {s + 1} tokens fit too"
        forward = cost.forward_budget(c, slo, 10_000)
        backward = cost.window_tokens(cost.room(c, slo) * BACKWARD_HEADROOM, True, 10_000)
        assert forward == min(cost.budget(c, slo, False, 10_000), backward)
    assert cost.budget(400, slo, False, 10_000) == 0  # inference alone overruns the SLO
    assert cost.budget(0, 1.0, False, limit=50) == 50  # capped


def test_refit_keeps_every_cost_nonnegative_and_follows_recent_iterations():
    cost = CostModel(window=8, refit_every=4)
    for c in (1, 2, 3, 4):  # timings that fall with load: a negative slope is dropped
        cost.add(c, 0, 0, 0.01 - 0.001 * c)
    assert all(w >= 0 for w in cost.coefficients)
    for _ in range(8):  # the recent window replaces what came before
        cost.add(10, 0, 0, 0.002)
        cost.add(20, 0, 0, 0.003)
    assert cost.predict(30) == pytest.approx(0.004, rel=1e-6)
    assert cost.coefficients[FEATURES.index("forward_token")] == 0.0  # never measured


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="must be a finite number > 0"):
        CoServe(0)
    with pytest.raises(ValueError, match="6 coefficients"):
        CostModel([1.0])
    with pytest.raises(ValueError, match="as two samples"):
        CostModel().add(3, 4, 0, 0.01)
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="--slo-tpot-ms must be a positive finite number"):
            EngineConfig(slo_tpot_s=bad)
        with pytest.raises(ValueError, match="time-per-output-token target must be a finite"):
            CoServe(bad)
    for name in ("mlq_slo_s", "mlq_refresh_s"):
        with pytest.raises(ValueError, match="must be a positive finite number"):
            EngineConfig(**{name: float("nan")})
    with pytest.raises(ValueError, match="--max-loras must be at most"):
        EngineConfig(max_adapters=10**6)
    with pytest.raises(ValueError, match="pass --jobs-dir"):
        ServerConfig(model="m", engine=EngineConfig(slo_tpot_s=0.05))


def test_cycles_slower_than_predicted_shrink_the_planned_iteration():
    coserve = CoServe(SLO, fixed_costs())
    need = _Need(backward=False, tokens=2)
    assert coserve._slot_for(1, need).target_s == SLO  # nothing measured yet
    for _ in range(20):  # cycles 1.25 times as long as predicted (the model cannot see why)
        coserve._last_return = time.perf_counter() - 0.00125
        coserve._note_cycle(0.001)
    assert 1.25 <= coserve.margin <= 4.0
    slot = coserve._slot_for(1, need)
    assert slot.target_s == pytest.approx(SLO / coserve.margin)
    assert slot.room_s == pytest.approx(coserve.cost.room(1, slot.target_s))
    coserve._last_return = time.perf_counter() - 1.0
    coserve._note_cycle(0.001)  # the engine waited for requests: not a prediction error
    assert len(coserve._errors) <= 20


# -- the hand-off ------------------------------------------------------------------------


class Recording(Executor):
    """The training model's executor: notes whether each call runs inside a slot."""

    def __init__(self, inner, coserve: CoServe):
        self.inner, self.coserve, self.in_slot = inner, coserve, []

    @property
    def manifest(self):
        return self.inner.manifest

    def call(self, op, layer, x):
        self.in_slot.append(self.coserve.in_slot)
        return self.inner.call(op, layer, x)

    def close(self):
        pass


def lora_model(path, executor):
    torch.manual_seed(0)
    model = load_client(path, executor)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, config)
    with torch.no_grad():  # B != 0, so every adapter weight gets a gradient
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    return model


def batch(length: int = 13):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, length - 4 :] = 0  # the second row is right-padded
    labels = ids.clone()
    labels[:, :4] = IGNORE_INDEX
    labels[mask == 0] = IGNORE_INDEX
    return ids, labels, mask


def whole_sequence_grads(model, ids, labels, mask) -> dict[str, torch.Tensor]:
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    return grads(model)


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return out


def assert_close(expected: dict, got: dict, tol: float = 1e-5) -> None:
    assert expected.keys() == got.keys() and expected
    for name in expected:
        diff = (expected[name] - got[name]).abs().max().item()
        assert diff < tol, f"{name}: differs by {diff:.2e}"


def assert_slots_within_budget(coserve: CoServe) -> None:
    """Every slot after an iteration of c tokens has the SLO less the inference part of
    f(c, 0), and the fine-tuning it ran fits that room: f(c, s) <= SLO. Only an idle slot
    may run one window over it (nothing to protect, and the step must progress)."""
    for record in coserve.history:
        slot = record.slot
        assert slot.target_s <= SLO  # the SLO over the measured prediction error
        assert slot.room_s == pytest.approx(coserve.cost.room(slot.inference_tokens, slot.target_s))
        assert record.forward_tokens + record.backward_tokens > 0
        if slot.from_engine or sum(record.windows) > 1:
            assert record.predicted_s <= slot.room_s + 1e-12, record


def test_windows_run_only_in_budgeted_slots_under_load(checkpoints, one_thread):
    path = checkpoints("llama")
    coserve = CoServe(SLO, fixed_costs(), idle_s=60.0)  # the engine never idles here
    executor = Recording(BaseExecutor.from_pretrained(path), coserve)
    model = lora_model(path, executor)
    ids, labels, mask = batch()
    expected = whole_sequence_grads(model, ids, labels, mask)
    executor.in_slot.clear()
    coserve._last_iteration = time.monotonic()
    stop = threading.Event()

    def engine():  # iterations of 1, 20 and 40 inference tokens, in turn
        while not stop.is_set():
            for c in (1, 20, 40):
                coserve.after_iteration(c, 1e-3)

    driver = threading.Thread(target=engine, daemon=True)
    driver.start()
    try:
        step = WindowedStep(model, ids, labels, mask)
        coserve.run_step(step)
    finally:
        stop.set()
        driver.join(10)
    assert_close(expected, grads(model))
    assert executor.in_slot and all(executor.in_slot), "a fine-tuning call ran outside a slot"
    records = list(coserve.history)
    assert all(r.slot.from_engine for r in records)
    loads = {r.slot.inference_tokens for r in records}
    assert loads <= {1, 20} and 40 not in loads  # no room after 40 tokens: no slot
    assert_slots_within_budget(coserve)
    assert max(b - a for a, b in step.bounds) <= 5  # backward within 80% of 3.9 ms: 10 tokens


def test_with_no_inference_the_job_gets_the_whole_budget(checkpoints, one_thread):
    path = checkpoints("llama")
    coserve = CoServe(SLO, fixed_costs())
    model = lora_model(path, BaseExecutor.from_pretrained(path))
    ids, labels, mask = batch()
    expected = whole_sequence_grads(model, ids, labels, mask)
    step = WindowedStep(model, ids, labels, mask)
    coserve.run_step(step)
    assert_close(expected, grads(model))
    # room at c=0: 4 ms. Slot 1: two forward windows of 5 positions (10 tokens, 2 ms each;
    # a window's backward must fit 80% of the room: 11 tokens). Slot 2: the last 3
    # positions (1.6 ms) and their backward (2.2 ms). Slots 3 and 4: a backward of 10
    # tokens (3 ms) each.
    assert step.bounds == [(0, 5), (5, 10), (10, 13)]
    records = list(coserve.history)
    assert [r.forward_tokens for r in records] == [20, 6, 0, 0]
    assert [r.backward_tokens for r in records] == [0, 6, 10, 10]
    assert [r.windows for r in records] == [(2, 0), (1, 1), (0, 1), (0, 1)]
    assert not any(r.slot.from_engine for r in records)
    assert all(r.slot.inference_tokens == 0 for r in records)
    assert_slots_within_budget(coserve)


def test_a_planned_step_runs_whole_windows_and_its_update_in_a_slot(checkpoints, one_thread):
    """With a window plan the step is cut where the plan says, whatever room the slots
    have, and the optimizer step (`finish`) runs inside the slot of the last window."""
    # room at c=0: 4 ms, half of it 2 ms: 10 forward tokens, 5 backward ones; but a window
    # of fewer than 10 tokens would cost more fixed than per token: 10 tokens, 5 positions
    # of 2 rows; 13 positions in 3 windows of at most 5 * 1.1: 5, 5 and 3
    assert plan_positions(fixed_costs(), SLO, rows=2, limit=13) == 5
    path = checkpoints("llama")
    coserve = CoServe(SLO, fixed_costs())
    model = lora_model(path, BaseExecutor.from_pretrained(path))
    ids, labels, mask = batch()
    expected = whole_sequence_grads(model, ids, labels, mask)
    step = WindowedStep(model, ids, labels, mask, plan=6)  # balanced: 3 windows of 5, 5, 3
    updates = []
    coserve.run_step(step, finish=lambda: updates.append(coserve.in_slot))
    assert step.bounds == [(0, 5), (5, 10), (10, 13)]
    assert_close(expected, grads(model))
    assert updates == [True], "the optimizer step did not run once, in a slot"
    records = list(coserve.history)
    assert sum(r.windows[0] for r in records) == 3 and sum(r.windows[1] for r in records) == 3
    assert records[-1].finish_s > 0 and coserve.finish_s == records[-1].finish_s
    with pytest.raises(ValueError, match=">= 1 position per window"):
        WindowedStep(model, ids, labels, mask, plan=0)


def test_slots_follow_real_engine_iterations(checkpoints, one_thread):
    """A real engine generates while a job's step runs in the slots after its iterations:
    the generated tokens are those of the engine alone, the gradients the whole step's."""
    path = checkpoints("llama")
    executor = BaseExecutor.from_pretrained(path)
    config = EngineConfig(max_running=4, max_batched_tokens=16, block_size=4, num_blocks=64)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    alone = Engine.from_pretrained(path, executor=executor, config=config).generate(prompts)

    engine = Engine.from_pretrained(path, executor=executor, config=config)
    coserve = CoServe(SLO, fixed_costs(), idle_s=60.0)  # no idle slots until released
    coserve._last_iteration = time.monotonic()
    engine.iteration_hook = coserve.after_iteration
    gate = PriorityGate()
    give_inference_priority(engine.model, gate)
    model = lora_model(path, TrainingExecutor(executor, gate, lambda: None))
    ids, labels, mask = batch(length=31)
    expected = whole_sequence_grads(model, ids, labels, mask)
    step = WindowedStep(model, ids, labels, mask)
    worker = threading.Thread(target=coserve.run_step, args=(step,), daemon=True)
    worker.start()
    while coserve._need is None:  # the worker waits for its first slot
        time.sleep(0.001)
    try:
        assert engine.generate(prompts) == alone
    finally:
        coserve.idle_s = 0.0  # the engine is idle now: the worker finishes on its own
        worker.join(60)
    assert not worker.is_alive()
    assert_close(expected, grads(model))
    engine_slots = [r for r in coserve.history if r.slot.from_engine]
    assert engine_slots, "no slot followed an engine iteration"
    assert_slots_within_budget(coserve)


# -- training in slots -----------------------------------------------------------------


def examples(n: int = 6) -> list[Example]:
    rng = random.Random(3)
    out = []
    for i in range(n):
        ids = tuple(rng.randrange(3, VOCAB) for _ in range(7 + i))
        out.append(Example(ids, (IGNORE_INDEX,) * 3 + ids[3:]))
    return out


def test_training_in_slots_gives_the_plain_loop_adapter(checkpoints, tmp_path, one_thread):
    path = checkpoints("llama")
    config = TrainConfig(epochs=1, batch_size=2, grad_accum=2, lr=1e-3, seed=0, log_every=1)
    data = examples(8)  # 2 steps of 2 micro-batches of 2
    results = {}
    for name in ("plain", "slots"):
        model = lora_model(path, BaseExecutor.from_pretrained(path))
        out = tmp_path / name
        if name == "plain":
            train(model, data, config, out, pad_token_id=0, progress=False)
        else:
            coserve = CoServe(SLO, fixed_costs())
            train_coserved(
                model, data, config, out, coserve=coserve, pad_token_id=0, progress=False
            )
            forwards = sum(r.forward_tokens > 0 for r in coserve.history)
            assert forwards > 4, "the 4 micro-batches were not cut into windows"
        results[name] = {
            n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad
        }
    assert_close(results["plain"], results["slots"])


# -- through `symbiont serve --slo-tpot-ms` ------------------------------------------------


def test_a_job_under_the_slo_target_trains_the_same_adapter(checkpoints, tmp_path):
    """The same job on a server with --slo-tpot-ms (while the base answers requests) and on
    one without: the adapters agree within 1e-5."""
    from tests.test_jobs_api import (
        BASE,
        ENGINE,
        LORA,
        add_char_tokenizer,
        chats,
        create,
        greedy,
        upload,
        wait_for,
    )

    model_dir = tmp_path / BASE
    shutil.copytree(checkpoints("llama"), model_dir)
    add_char_tokenizer(model_dir)
    adapters = {}
    window = {"window_positions": 4}
    for name, slo in (("plain", None), ("slots", 0.05)):
        engine = dataclasses.replace(ENGINE, slo_tpot_s=slo)
        jobs_dir = tmp_path / f"jobs-{name}"
        config = ServerConfig(model=str(model_dir), port=0, engine=engine, jobs_dir=str(jobs_dir))
        with BackgroundServer(config) as server:
            api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
            data = upload(api, chats(6))
            hyper = {"n_epochs": 2, "batch_size": 2}
            # windows of 4 positions: they fit the slots after this tiny engine's iterations
            job = create(api, data.id, hyperparameters=hyper, peft=LORA, extra=window)
            while api.fine_tuning.jobs.retrieve(job.id).status in ACTIVE:
                greedy(api, BASE, "hi 3", n=4)  # the base keeps answering meanwhile
            assert wait_for(api, job.id).status == "succeeded"
            jobs = server._server.config.app.state.jobs
            adapters[name] = load_file(jobs.store.run_dir(job.id) / "adapter_model.safetensors")
            if slo is not None:
                history = jobs.runner.coserve.history
                assert any(r.slot.from_engine for r in history), "no slot after an iteration"
    assert_close(adapters["plain"], adapters["slots"])
