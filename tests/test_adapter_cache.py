"""The adapter cache behind `--adapter-dir` (symbiont/serve/adapter_cache.py), on the engine.

Adapters of a folder are loaded on first use off the engine thread, once however many
requests wait; more adapters than slots still give vanilla peft's greedy tokens; an
adapter in use is never evicted; eviction follows the policy; bad folders fail alone.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from symbiont.serve import Engine, EngineConfig, Request, SamplingParams
from symbiont.serve.adapter_cache import (
    AdapterCache,
    AdapterFailed,
    AdapterState,
    CachedAdapter,
    cost_scores,
    name_problem,
)
from symbiont.serve.adapters import AdapterError, AdapterNotFound
from symbiont.serve.config import CachePolicy
from symbiont.serve.http.metrics import MAX_ADAPTER_LABELS, ServeMetrics
from symbiont.serve.output import EngineObserver
from tests.test_serve_common import Reference, lora_config, make_adapters, prompts, save_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
SMALL = EngineConfig(
    max_running=8, max_batched_tokens=64, block_size=4, num_blocks=128, max_adapters=2
)


@pytest.fixture(scope="module")
def base(checkpoints):
    return checkpoints("llama")


@pytest.fixture(scope="module")
def folder(base, tmp_path_factory):
    """Six good adapters (LoRA ranks 2-16, two IA3) under one folder."""
    root = tmp_path_factory.mktemp("adapter-dir")
    make_adapters(base, root)
    return root


@pytest.fixture(scope="module")
def reference(base, folder):
    return Reference(base, {p.name: p for p in folder.iterdir()})


def engine_on(base, root, config: EngineConfig = SMALL, observer=None) -> Engine:
    engine = Engine.from_pretrained(base, config=config, observer=observer)
    engine.attach_adapter_dir(root)
    return engine


class Counts(EngineObserver):
    def __init__(self):
        self.loads, self.evictions, self.lookups = [], [], []

    def on_adapter_load(self, seconds, ok):
        self.loads.append(ok)

    def on_adapter_evict(self, tier):
        self.evictions.append(tier)

    def on_adapter_cache(self, tier, hit):
        self.lookups.append((tier, hit))


def run_all(engine: Engine, requests: list[Request]) -> None:
    for request in requests:
        engine.add_request(request)
    for _ in range(2000):
        if all(r.finished for r in requests):
            return
        engine.step()
        if engine.stalled:
            threading.Event().wait(0.002)
    raise AssertionError("requests did not finish")


def test_more_adapters_than_slots_each_equal_vanilla_peft(base, folder, reference, one_thread):
    engine = engine_on(base, folder)
    names = sorted(p.name for p in folder.iterdir()) * 2  # 6 adapters, 2 slots, 12 requests
    batch = prompts(len(names), seed=3)
    outputs = engine.generate(batch, names, GREEDY)
    for prompt, name, out in zip(batch, names, outputs, strict=True):
        assert out == reference.generate(prompt, name, GREEDY.max_tokens), name
    states = [card["state"] for card in engine.cache.cards()]
    assert states.count("resident") == 2 and states.count("host") == 4


def test_cold_adapter_is_loaded_once_off_the_engine_thread(base, folder, monkeypatch, one_thread):
    """Five requests for one cold adapter: one load, on a loader thread, while a base
    request runs to the end on the engine thread."""
    engine = engine_on(base, folder)
    gate, threads = threading.Event(), []
    parse = engine.adapters.parse

    def slow_parse(path):
        threads.append(threading.current_thread())
        gate.wait(30)
        return parse(path)

    monkeypatch.setattr(engine.adapters, "parse", slow_parse)
    cold = [Request(f"c{i}", [5, 6, 7 + i], "lora4", GREEDY) for i in range(5)]
    for request in cold:
        engine.add_request(request)
    assert engine.cache.state("lora4") is AdapterState.LOADING, "queued adapters prefetch"
    base_request = Request("b", [5, 6, 7], None, GREEDY)
    engine.add_request(base_request)
    for _ in range(50):
        engine.step()
        if base_request.finished:
            break
    assert base_request.finished and not any(r.finished for r in cold)
    gate.set()
    run_all(engine, [])
    while not all(r.finished for r in cold):
        engine.step()
    assert len(threads) == 1 and threads[0] is not threading.main_thread()
    assert engine.cache.lookup("lora4").hits == 5


def test_adapter_in_use_keeps_its_slot_and_host_memory(base, folder, reference, one_thread):
    """One slot: B waits (in host memory) while A's request runs; A is never evicted
    mid-request; a tiny host budget still keeps adapters that requests hold."""
    config = EngineConfig(
        max_running=8, max_batched_tokens=64, block_size=4, num_blocks=128, max_adapters=1,
        host_cache_bytes=1,
    )  # fmt: skip
    counts = Counts()
    engine = engine_on(base, folder, config, counts)
    a = Request("a", [4, 5, 6], "lora4", SamplingParams(temperature=0.0, max_tokens=12))
    b = Request("b", [4, 5, 6], "lora16", GREEDY)
    engine.add_request(a)
    while not a.sequences[0].output_ids:
        engine.step()
    engine.add_request(b)
    while not a.finished:
        engine.step()
        assert engine.cache.state("lora4") is AdapterState.RESIDENT, "evicted while running"
        assert not b.sequences[0].output_ids, "B ran without a slot"
        assert engine.cache.state("lora16") in (AdapterState.LOADING, AdapterState.HOST)
    run_all(engine, [])
    while not b.finished:
        engine.step()
    assert a.sequences[0].output_ids == reference.generate([4, 5, 6], "lora4", 12)
    assert b.sequences[0].output_ids == reference.generate([4, 5, 6], "lora16", 6)
    assert engine.cache.state("lora4") is AdapterState.DISK, "an idle adapter over budget stays"
    assert counts.evictions.count("resident") == 1
    assert engine.cache.host_bytes() <= engine.cache.lookup("lora16").bytes


@pytest.mark.parametrize("policy", ["fifo", "mlq"])
def test_a_request_waiting_for_a_slot_reserves_the_one_that_frees_first(
    base, folder, reference, one_thread, policy
):
    """Two slots, both busy: a long request on lora4, a short one on lora16. A request
    for ia3 (in host memory) waits for lora16's slot, which frees first; a flood for
    lora4 keeps starting meanwhile, past --max-skips, because it does not delay that
    slot (the line used to close after max_skips skippers); ia3 starts as soon as the
    short request ends, long before the long one."""
    config = EngineConfig(
        max_running=8, max_batched_tokens=64, block_size=4, num_blocks=256, max_adapters=2,
        max_skips=2, scheduler=policy,
    )  # fmt: skip
    engine = engine_on(base, folder, config)
    long = Request("long", [4, 5, 6], "lora4", SamplingParams(temperature=0.0, max_tokens=40))
    short = Request("short", [4, 5, 6], "lora16", SamplingParams(temperature=0.0, max_tokens=6))
    for request in (long, short):
        engine.add_request(request)
    while not (long.sequences[0].output_ids and short.sequences[0].output_ids):
        engine.step()
        if engine.stalled:
            threading.Event().wait(0.002)
    waiting = Request("waiting", [7, 8, 9], "ia3", GREEDY)
    engine.add_request(waiting)
    for _ in range(5000):
        if engine.cache.state("ia3") is AdapterState.HOST:
            break
        threading.Event().wait(0.002)
    flood, short_done_at, step = [], None, 0
    while waiting.sequences[0].admitted_at is None:
        flood.append(Request(f"f{len(flood)}", [3, 4], "lora4", SamplingParams(max_tokens=2)))
        engine.add_request(flood[-1])
        engine.step()
        step += 1
        if short.finished and short_done_at is None:
            short_done_at = step
        assert step < 60, "the waiting request never got a slot"
    started = waiting.sequences[0].admitted_at
    skipped = [r for r in flood if (r.sequences[0].admitted_at or started) < started]
    assert len(skipped) > config.max_skips, "skippers onto another slot were bounded"
    assert short_done_at is not None and step <= short_done_at + 1, "waited past the free slot"
    assert not long.finished, "it waited for the long request"
    run_all(engine, [])
    while not all(r.finished for r in [long, waiting, *flood]):
        engine.step()
    assert waiting.sequences[0].output_ids == reference.generate([7, 8, 9], "ia3", 6)
    assert long.sequences[0].output_ids == reference.generate([4, 5, 6], "lora4", 40)


def test_cost_policy_keeps_frequent_large_adapters_lru_keeps_recent():
    old_hot = CachedAdapter("hot", None, hits=10, bytes=1000, tick=1)
    new_cold = CachedAdapter("cold", None, hits=1, bytes=100, tick=9)
    scores = cost_scores([old_hot, new_cold])
    assert scores["hot"] == pytest.approx(0.45 + 0.0 + 0.45)
    assert scores["cold"] == pytest.approx(0.045 + 0.10 + 0.045)
    for policy, victim in [(CachePolicy.COST, "cold"), (CachePolicy.LRU, "hot")]:
        cache = AdapterCache.__new__(AdapterCache)
        cache.config = EngineConfig(cache_policy=policy)
        assert cache._lowest([old_hot, new_cold]).name == victim, policy
    held = CachedAdapter("held", None, hits=0, bytes=1, tick=0, refs=1)
    assert cache._lowest([held, old_hot]).name == "hot", "a referenced adapter went first"


def test_host_tier_is_bounded_by_bytes(base, folder, one_thread):
    """A budget a bit over one LoRA-4 adapter: using five in turn never holds more (once
    the requests holding them are done), evicting idle ones from host memory."""
    engine = engine_on(base, folder)
    size = engine.cache.lookup("lora4").bytes  # file bytes; tensors take about as much
    config = EngineConfig(
        max_running=8, max_batched_tokens=64, block_size=4, num_blocks=128, max_adapters=1,
        host_cache_bytes=int(1.2 * size),
    )  # fmt: skip
    counts = Counts()
    engine = engine_on(base, folder, config, counts)
    for i, name in enumerate(["lora4", "rslora2", "ia3", "ia3_b", "lora4"]):
        run_all(engine, [Request(f"r{i}", [3, 4], name, GREEDY)])
        assert engine.cache.host_bytes() <= config.host_cache_bytes
    assert "host" in counts.evictions
    assert counts.loads == [True] * (len(counts.loads)) and len(counts.loads) >= 5


@pytest.fixture
def bad_folder(base, folder, tmp_path):
    """Good adapters next to every kind of bad one, and a valid adapter outside."""
    root = tmp_path / "dir"
    root.mkdir()
    for name in ("lora4", "ia3"):
        shutil.copytree(folder / name, root / name)
    bad = {
        "broken-json": lambda p: (p / "adapter_config.json").write_text("{not json"),
        "no-weights": lambda p: (p / "adapter_model.safetensors").unlink(),
        "wrong-shape": _reshape_weights,
        "nan-weights": _nan_weights,
        "a..b": lambda p: None,
    }
    for name, spoil in bad.items():
        shutil.copytree(folder / "lora4", root / name)
        spoil(root / name)
    save_adapter(base, lora_config("llama", 16), root / "rank-16", seed=5)
    shutil.copytree(folder / "lora4", tmp_path / "outside")
    os.symlink(tmp_path / "outside", root / "link-out")
    (root / "not-an-adapter").mkdir()
    (root / "file.txt").write_text("x")
    return root


def _reshape_weights(path):
    file = path / "adapter_model.safetensors"
    tensors = load_file(file)
    save_file({k: torch.zeros(v.shape[0], v.shape[1] + 1) for k, v in tensors.items()}, file)


def _nan_weights(path):
    file = path / "adapter_model.safetensors"
    save_file({k: torch.full_like(v, float("nan")) for k, v in load_file(file).items()}, file)


def test_bad_folders_fail_alone_with_their_reason(base, bad_folder, reference, monkeypatch):
    config = EngineConfig(block_size=4, num_blocks=128, max_lora_rank=8, max_adapters=2)
    engine = Engine.from_pretrained(base, config=config)
    inspected = []
    inspect = engine.adapters.inspect
    monkeypatch.setattr(engine.adapters, "inspect", lambda p: inspected.append(p) or inspect(p))
    cache = engine.attach_adapter_dir(bad_folder)
    cards = {card["id"]: card for card in cache.cards()}
    assert set(cards) == {
        "lora4", "ia3", "broken-json", "no-weights", "wrong-shape", "nan-weights", "a..b",
        "rank-16", "link-out",
    }  # fmt: skip
    reasons = {name: card["reason"] or "" for name, card in cards.items()}
    assert "not valid JSON" in reasons["broken-json"]
    assert "adapter_model.safetensors" in reasons["no-weights"]
    assert "another base" in reasons["wrong-shape"]
    assert "max_lora_rank" in reasons["rank-16"] and "--max-lora-rank 16" in reasons["rank-16"]
    assert "'..'" in reasons["a..b"]
    assert "outside --adapter-dir" in reasons["link-out"]
    assert cards["nan-weights"]["state"] == "disk", "values are checked when loaded"
    assert all(os.path.realpath(p).startswith(str(bad_folder)) for p in inspected)
    assert not any("outside" in str(p) for p in inspected), "read a folder outside the dir"
    for name in ["broken-json", "no-weights", "wrong-shape", "a..b", "rank-16", "link-out"]:
        with pytest.raises(AdapterFailed, match=f"adapter '{name}'"):
            engine.add_request(Request(f"r-{name}", [3, 4], name, GREEDY))
    for name in ["not-an-adapter", "file.txt", "../outside", "missing", "a\0b"]:
        with pytest.raises(AdapterNotFound, match="/v1/adapters"):
            engine.add_request(Request(f"r-{name}", [3, 4], name, GREEDY))
    nan = Request("nan", [3, 4], "nan-weights", GREEDY)
    good = [Request(f"ok-{n}", [3, 4, 5], n, GREEDY) for n in ("lora4", "ia3")]
    run_all(engine, [nan, *good])
    assert "adapter 'nan-weights' cannot be served" in nan.error and "NaN" in nan.error
    assert cache.state("nan-weights") is AdapterState.FAILED
    for request in good:
        want = reference.generate([3, 4, 5], request.adapter, GREEDY.max_tokens)
        assert request.error is None and request.sequences[0].output_ids == want
    shutil.copy(bad_folder / "lora4" / "adapter_config.json", bad_folder / "broken-json")
    os.utime(bad_folder / "broken-json" / "adapter_config.json", ns=(1, 1))  # a changed stamp
    cache.scan()
    assert cache.state("broken-json") is AdapterState.DISK, "a fixed folder is retried"
    assert cache.state("no-weights") is AdapterState.FAILED, "an unchanged one stays failed"


def test_name_problems():
    assert name_problem("ok-name_1.2") is None
    for bad in ["", "a/b", "..", "a..b", "x\0", ".hidden", "a\\b", "x" * 256]:
        assert name_problem(bad), bad


def test_adapter_labels_on_request_metrics_are_bounded():
    metrics = ServeMetrics()
    for i in range(3 * MAX_ADAPTER_LABELS):
        metrics.on_request(f"tenant-{i}")
    metrics.on_request(None)
    text = metrics.render().decode()
    series = [
        line for line in text.splitlines() if line.startswith("symbiont_adapter_requests_total")
    ]
    assert len(series) == MAX_ADAPTER_LABELS + 2  # + "other" + the base
    assert f'adapter="other"}} {2.0 * MAX_ADAPTER_LABELS}' in text


def test_an_adapter_that_cannot_be_placed_fails_alone(base, folder, reference, monkeypatch):
    """Out of memory growing a slot's stacks escaped `Engine.step` and stopped the engine
    for every request, and the slot it had taken was lost."""
    from symbiont.serve.adapters import AdapterLayer

    engine = engine_on(base, folder)
    put = AdapterLayer.put

    def out_of_memory_for_lora16(self, slot, weights, max_rank):
        if weights is not None and getattr(weights, "rank", None) == 16:
            raise MemoryError("cannot allocate 16 GB")
        return put(self, slot, weights, max_rank)

    monkeypatch.setattr(AdapterLayer, "put", out_of_memory_for_lora16)
    free = engine.adapters.num_free_slots
    names = ["lora16", "lora4", None]
    batch = prompts(len(names), seed=23)
    requests = [Request(f"r{i}", p, n, GREEDY) for i, (p, n) in enumerate(zip(batch, names, strict=True))]  # fmt: skip
    run_all(engine, requests)
    assert "could not be placed in a slot (MemoryError" in requests[0].error
    for prompt, name, request in zip(batch[1:], names[1:], requests[1:], strict=True):
        assert request.error is None, request.error
        assert request.sequences[0].output_ids == reference.generate(
            prompt, name, GREEDY.max_tokens
        )
    assert engine.adapters.num_free_slots >= free - 1, "the failed placement kept no slot"


def test_adapters_loaded_by_name_share_the_slots_with_the_folder(base, folder, reference):
    """With idle folder adapters in every slot, POST /v1/adapters (and a job publishing
    its model) failed with 'all slots in use'; when adapters loaded by name took every
    slot, folder requests waited forever. Now an idle folder adapter makes room, and the
    last slot stays the folder's."""
    engine = engine_on(base, folder)  # SMALL: 2 slots
    names = ["lora4", "ia3"]  # fill both slots, then go idle
    batch = prompts(2, seed=29)
    run_all(engine, [Request(f"r{i}", p, n, GREEDY) for i, (p, n) in enumerate(zip(batch, names, strict=True))])  # fmt: skip
    assert engine.adapters.num_free_slots == 0
    engine.load_adapter("named", folder / "lora16")  # an idle folder adapter is evicted
    with pytest.raises(AdapterError, match="would leave no adapter slot for --adapter-dir"):
        engine.load_adapter("second", folder / "rslora2")
    prompt = prompts(1, seed=31)[0]
    request = Request("after", prompt, "lora8_attn", GREEDY)
    run_all(engine, [request])
    assert request.sequences[0].output_ids == reference.generate(
        prompt, "lora8_attn", GREEDY.max_tokens
    )
    full = Engine.from_pretrained(base, config=dataclasses.replace(SMALL, max_adapters=1))
    full.load_adapter("only", folder / "lora4")
    with pytest.raises(AdapterError, match="--adapter-dir needs a free adapter slot"):
        full.attach_adapter_dir(folder)


def test_a_changed_or_removed_folder_is_served_as_it_is_now(base, folder, reference, tmp_path):
    """A folder replaced with other weights kept serving the old ones from its slot (and
    its old method: a new prompt-tuning adapter could block the queue); a removed folder
    kept being served."""
    root = tmp_path / "dir"
    root.mkdir()
    shutil.copytree(folder / "lora4", root / "tenant")
    engine = engine_on(base, root)
    prompt = prompts(1, seed=37)[0]
    assert engine.generate([prompt], ["tenant"], GREEDY)[0] == reference.generate(
        prompt, "lora4", GREEDY.max_tokens
    )
    shutil.rmtree(root / "tenant")
    shutil.copytree(folder / "lora16", root / "tenant")  # re-published: other weights, rank
    engine.cache.scan()  # what GET /v1/models does
    assert engine.generate([prompt], ["tenant"], GREEDY)[0] == reference.generate(
        prompt, "lora16", GREEDY.max_tokens
    )
    assert {c["id"]: c["rank"] for c in engine.cache.cards()}["tenant"] == 16
    shutil.rmtree(root / "tenant")
    engine.cache.scan()
    with pytest.raises(AdapterNotFound):
        engine.add_request(Request("gone", prompt, "tenant", GREEDY))
    assert engine.generate([prompt], [None], GREEDY), "the engine goes on"


def test_a_cancelled_waiter_does_not_cancel_the_shared_load(base, folder):
    """A request handler cancelled while its adapter's load was still queued cancelled
    that load, which every request for the adapter shares: it stayed 'loading' forever."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from symbiont.serve.http import api

    engine = engine_on(base, folder)
    cache = engine.cache
    release = threading.Event()
    blockers = [cache._pool.submit(release.wait) for _ in range(4)]  # every loader busy
    state = SimpleNamespace(ready=lambda: SimpleNamespace(engine=engine))
    original = api._cache
    api._cache = lambda _: cache
    try:

        async def wait_for_adapter():
            async with api._adapter_in_memory(state, "lora4"):
                pass

        async def main():
            task = asyncio.ensure_future(wait_for_adapter())
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            release.set()
            for _ in range(200):
                if cache.state("lora4") == "host":
                    return
                await asyncio.sleep(0.01)

        asyncio.run(main())
    finally:
        api._cache = original
        release.set()
    assert all(b.done() for b in blockers)
    assert cache.state("lora4") == "host", "the shared load was cancelled"
