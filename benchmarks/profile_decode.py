"""Where a base-only decode step of `symbiont serve`'s engine spends its time (issue 17).

    python benchmarks/profile_decode.py --model default --batch 32 --steps 48

Three measurements on the same checkpoint, batch and prompts (base model only, greedy,
EOS ignored):

1. Engine phases, plain timers (no profiler): `batch` requests are prefilled, then
   `--steps` decode steps (one token for every sequence each) are timed phase by phase
   by wrapping the engine's own callables: scheduling (`scheduler.schedule`), batch
   preparation (`runner.prepare`), the model forward (`runner.forward`), sampling
   (`decoding.sample` and the log-probability pick), output processing
   (`output.append`: stop rule, bookkeeping) and, inside it, detokenisation
   (`TextTracker.update`); the rest of `Engine.step` is reported as "step, other".
2. The forward split, torch.profiler on further decode steps: matmul (aten mm/addmm/
   bmm/linear, outside attention), attention (everything under the paged attention
   function), other tensor ops (norms, rotary, embedding, adds), and Python overhead
   (forward wall time minus the time of all tensor ops). The fractions are applied to
   the unprofiled forward time of (1), since the profiler inflates Python time.
3. HTTP: the same batch through `BackgroundServer` (streaming /v1/completions, token-id
   prompts); the engine thread's time outside `Engine.step` between steps is what the
   server (asyncio event loop, HTTP framing, SSE encoding, handing outputs over, the GIL
   they share with the engine thread) costs each step.

Prints a table of ms per decode step and % of the step; `--json PATH` writes it.

`--fusion-ab ROUNDS` instead times decode steps of one engine in three settings taken in
turn, ROUNDS times (so a changing load hits all alike; each setting takes each place in
the order in turn, as contexts grow), and prints ms per step and the ratio to the first: `inference_mode, one call per layer` (the forward before q/k/v and
gate/up calls were fused), `no_grad, one call per layer` (what the version counter costs)
and `no_grad, fused` (the engine's default: one executor call and one matmul for q/k/v
and for gate/up).

    python benchmarks/profile_decode.py --model default --batch 32 --fusion-ab 6

`--lean-ab ROUNDS` times decode steps with transformers' forward of the model and the
engine's lean forward (symbiont/serve/lean.py), taken in turn:

    python benchmarks/profile_decode.py --model default --batch 16 --steps 10 --lean-ab 10

`--kernel-ab ROUNDS` likewise times decode steps with PyTorch's SDPA and with symbiont's
decode attention kernel (symbiont/serve/decode_kernel.py):

    python benchmarks/profile_decode.py --model default --batch 16 --prompt-len 512 --kernel-ab 6

`--direct-ab ROUNDS` likewise times decode steps with the lean forward calling its
projection modules and calling the executor directly (symbiont/serve/lean.py):

    python benchmarks/profile_decode.py --model default --batch 16 --steps 20 --direct-ab 16

`--layer-ops-ab ROUNDS` likewise times decode steps, then the prefill of one new prompt of
`--prompt-len` tokens per setting and round, with PyTorch's norms and rotary embedding and
with symbiont's layer kernels (symbiont/serve/layer_ops.py):

    python benchmarks/profile_decode.py --model default --batch 16 --steps 20 --layer-ops-ab 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections import defaultdict

import torch

MATMUL_OPS = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::matmul",
    "aten::linear",
    "mkldnn::_linear_pointwise",  # the packed weights of --prepack (symbiont/base/prepack.py)
}


class Timers:
    """Accumulated wall time per phase name while `active`."""

    def __init__(self):
        self.total = defaultdict(float)
        self.active = False

    def wrap(self, name: str, fn):
        def timed(*args, **kw):
            if not self.active:
                return fn(*args, **kw)
            start = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.total[name] += time.perf_counter() - start

        return timed


def instrument(engine, timers: Timers) -> None:
    """Wrap the engine's phases (instance attributes and the module-level functions the
    engine calls) with `timers`."""
    import symbiont.serve.engine as engine_module
    from symbiont.decoding import TextTracker

    engine.scheduler.schedule = timers.wrap("scheduling", engine.scheduler.schedule)
    engine.runner.prepare = timers.wrap("batch preparation", engine.runner.prepare)
    engine.runner.forward = timers.wrap("forward", engine.runner.forward)
    engine.output.append = timers.wrap("output processing", engine.output.append)
    engine_module.sample = timers.wrap("sampling", engine_module.sample)
    engine_module._sampled_logprobs = timers.wrap("sampling", engine_module._sampled_logprobs)
    if not getattr(TextTracker.update, "_profiled", False):
        update = timers.wrap("detokenisation", TextTracker.update)
        update._profiled = True
        TextTracker.update = update
    engine.step = timers.wrap("step", engine.step)


def requests(args, vocab: int):
    from symbiont.decoding import SamplingParams
    from symbiont.serve.sequence import Request

    gen = torch.Generator().manual_seed(args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [
        torch.randint(10, vocab, (args.prompt_len,), generator=gen).tolist()
        for _ in range(args.batch)
    ]
    return prompts, [
        Request(f"profile-{i}", prompt, None, params) for i, prompt in enumerate(prompts)
    ]


def engine_phases(args, engine) -> tuple[dict[str, float], int]:
    """ms per decode step of each phase (plain timers)."""
    timers = Timers()
    instrument(engine, timers)
    _, reqs = requests(args, engine.runner.vocab_size)
    for request in reqs:
        engine.add_request(request)
    while any(seq.num_computed < seq.prompt_len for r in reqs for seq in r.sequences):
        engine.step()  # prefill (chunked) until every sequence decodes
    for _ in range(3):
        engine.step()  # warm
    timers.active = True
    for _ in range(args.steps):
        engine.step()
    timers.active = False
    sequences = sum(1 for r in reqs for s in r.sequences if not s.finished)
    per_step = {k: v * 1000 / args.steps for k, v in timers.total.items()}
    return per_step, sequences, reqs  # noqa: RET504


def forward_split(args, engine) -> dict[str, float]:
    """Fractions of the forward's time: matmul, attention, other ops, Python."""
    from transformers import AttentionInterface

    from symbiont.serve.attention import ATTN_IMPLEMENTATION, paged_attention

    def attention(*a, **kw):
        with torch.profiler.record_function("symbiont::attention"):
            return paged_attention(*a, **kw)

    from symbiont.serve import lean

    # transformers' forward finds attention through its registry; the lean forward
    # (the default) calls it by name
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention)
    lean.paged_attention = attention
    forward = engine.runner.forward
    walls = []

    def timed_forward(batch):
        with torch.profiler.record_function("symbiont::forward"):
            start = time.perf_counter()
            out = forward(batch)
            walls.append(time.perf_counter() - start)
            return out

    engine.runner.forward = timed_forward
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.profile_steps):
            engine.step()
    engine.runner.forward = forward
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    lean.paged_attention = paged_attention
    totals = defaultdict(float)
    for event in prof.events():
        if event.name == "symbiont::forward":
            totals["forward"] += event.cpu_time_total
            continue
        if event.name == "symbiont::attention":  # all of it: ops, Python, the CPU kernel
            totals["attention"] += event.cpu_time_total
            continue
        is_op = event.name.startswith(("aten::", "mkldnn::"))
        if not is_op or not _inside(event, "symbiont::forward"):
            continue
        self_us = event.self_cpu_time_total
        if _inside(event, "symbiont::attention"):
            continue  # counted with its range
        if event.name in MATMUL_OPS:
            totals["matmul"] += self_us
        else:
            totals["other tensor ops"] += self_us
    ops = totals["attention"] + totals["matmul"] + totals["other tensor ops"]
    totals["python overhead"] = max(0.0, totals["forward"] - ops)
    return {k: totals[k] / totals["forward"] for k in totals if k != "forward"}


def _inside(event, name: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.cpu_parent
    return False


def http_cost(args, model: str) -> tuple[float, float, int]:
    """(ms per step outside Engine.step, ms per step inside it, steps) through the HTTP
    server, measured over the whole run (prefill steps included)."""
    import httpx

    from symbiont.serve import EngineConfig
    from symbiont.serve.config import ServerConfig
    from symbiont.serve.engine import Engine
    from symbiont.serve.http.server import BackgroundServer

    stamps = []  # (start, end) of every Engine.step
    step = Engine.step

    def timed_step(self):
        start = time.perf_counter()
        out = step(self)
        if not self.stalled:
            stamps.append((start, time.perf_counter()))
        return out

    Engine.step = timed_step
    config = ServerConfig(
        model=model,
        port=0,
        served_model_name="base",
        engine=EngineConfig(
            max_running=args.batch,
            max_batched_tokens=args.max_batched_tokens,
            max_queue=args.batch + 1,
            decode_kernel=not args.sdpa,
        ),
        prepack=args.prepack,
    )
    try:
        with BackgroundServer(config) as server:
            prompts, _ = requests(args, 10_000 if model is None else _vocab(model))

            async def run_all():
                async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:

                    async def one(prompt):
                        body = {
                            "model": "base",
                            "prompt": prompt,
                            "max_tokens": args.max_tokens,
                            "temperature": 0,
                            "ignore_eos": True,
                            "stream": True,
                        }
                        async with client.stream("POST", "/v1/completions", json=body) as r:
                            async for _ in r.aiter_lines():
                                pass

                    await asyncio.gather(*(one(p) for p in prompts[:4]))  # warm
                    stamps.clear()
                    await asyncio.gather(*(one(p) for p in prompts))

            asyncio.run(run_all())
    finally:
        Engine.step = step
    inside = sum(end - start for start, end in stamps)
    span = stamps[-1][1] - stamps[0][0]
    n = len(stamps)
    return (span - inside) * 1000 / n, inside * 1000 / n, n


FUSION_ARMS = (
    ("inference_mode, one call per layer", True, False),
    ("no_grad, one call per layer", False, False),
    ("no_grad, fused q/k/v + gate/up", False, True),
)


def set_fusion(engine, fused: bool) -> None:
    """Fuse (or not) the engine model's calls on its in-process executor."""
    from symbiont.client.virt import VirtLayer

    for module in engine.model.modules():
        if isinstance(module, VirtLayer):
            executor = module.executor
            executor.fuses_calls = fused  # the instance's setting hides the class's
            module.executor = executor  # VirtLayers read it when linked


def fusion_ab(args, engine) -> list[tuple[str, float, float]]:
    """(arm, ms per decode step, ms per forward) of each FUSION_ARMS setting, taken in
    turn for `args.fusion_ab` rounds of `args.steps` steps each."""
    _, reqs = requests(args, engine.runner.vocab_size)
    for request in reqs:
        engine.add_request(request)
    while any(seq.num_computed < seq.prompt_len for r in reqs for seq in r.sequences):
        engine.step()
    forward = engine.runner.forward
    step_s, forward_s = defaultdict(float), defaultdict(float)
    for round_ in range(args.fusion_ab):
        # Contexts grow each step, so each setting takes each place in a round in turn.
        turn = round_ % len(FUSION_ARMS)
        for name, inference_mode, fused in FUSION_ARMS[turn:] + FUSION_ARMS[:turn]:
            set_fusion(engine, fused)
            timers = Timers()
            mode = torch.inference_mode if inference_mode else contextlib.nullcontext

            def in_mode(batch, mode=mode):
                with mode():
                    return forward(batch)

            engine.runner.forward = timers.wrap("forward", in_mode)
            engine.step()  # warm: the first fused forward learns which layer follows which
            timers.active = True
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            step_s[name] += time.perf_counter() - start
            forward_s[name] += timers.total["forward"]
    engine.runner.forward = forward
    set_fusion(engine, True)
    n = args.fusion_ab * args.steps
    return [(name, step_s[name] * 1000 / n, forward_s[name] * 1000 / n) for name, *_ in FUSION_ARMS]


def alternate(args, engine, rounds: int, arms) -> list[tuple[str, float]]:
    """(arm, ms per decode step) of each (name, apply) arm, `apply()` switching the
    engine to it, taken in turn (order alternating per round) for `rounds` rounds of
    `args.steps` decode steps each, after every prompt is prefilled."""
    _, reqs = requests(args, engine.runner.vocab_size)
    for request in reqs:
        engine.add_request(request)
    while any(seq.num_computed < seq.prompt_len for r in reqs for seq in r.sequences):
        engine.step()
    step_s = defaultdict(float)
    for round_ in range(rounds):
        for name, apply in arms if round_ % 2 == 0 else arms[::-1]:
            apply()
            engine.step()  # warm
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            step_s[name] += time.perf_counter() - start
    return [(name, step_s[name] * 1000 / (rounds * args.steps)) for name, _ in arms]


def lean_ab(args, engine) -> list[tuple[str, float]]:
    """Transformers' forward against the lean one (symbiont/serve/lean.py)."""
    runner, lean = engine.runner, engine.runner.lean
    if lean is None:
        raise SystemExit(f"{args.model}: no lean forward for this architecture")
    arms = (
        ("transformers forward", lambda: setattr(runner, "lean", None)),
        ("lean forward", lambda: setattr(runner, "lean", lean)),
    )
    try:
        return alternate(args, engine, args.lean_ab, arms)
    finally:
        runner.lean = lean


def kernel_ab(args, engine) -> list[tuple[str, float]]:
    """PyTorch's SDPA against symbiont's decode kernel (symbiont/serve/decode_kernel.py)."""
    runner, kernel = engine.runner, engine.runner.decode_kernel
    if kernel is None:
        from symbiont.serve import decode_kernel

        raise SystemExit(f"no decode kernel here: {decode_kernel.unavailable_reason()}")
    arms = (
        ("SDPA", lambda: setattr(runner, "decode_kernel", None)),
        ("decode kernel", lambda: setattr(runner, "decode_kernel", kernel)),
    )
    try:
        return alternate(args, engine, args.kernel_ab, arms)
    finally:
        runner.decode_kernel = kernel


def direct_ab(args, engine) -> list[tuple[str, float]]:
    """The lean forward calling its projection modules, against calling the executor
    directly where they are bare VirtLayers (symbiont/serve/lean.py, `_project`)."""
    lean = engine.runner.lean
    if lean is None:
        raise SystemExit(f"{args.model}: no lean forward for this architecture")
    arms = (
        ("projection modules", lambda: setattr(lean, "direct", False)),
        ("executor called directly", lambda: setattr(lean, "direct", True)),
    )
    try:
        return alternate(args, engine, args.direct_ab, arms)
    finally:
        lean.direct = True


def product_ab(args, engine) -> list[tuple[str, float]]:
    """The lean forward's direct executor calls made as usual calls (`executor.call`,
    `forward_fused`: checks and lookups per call) against the executor's products bound
    to each projection once (`PrepackedExecutor.direct_product`, symbiont/base/prepack.py)."""
    from symbiont.serve import lean as lean_module

    if engine.runner.lean is None:
        raise SystemExit(f"{args.model}: no lean forward for this architecture")
    if not args.prepack:
        raise SystemExit("only the serving executor offers direct products: pass --prepack")
    bound = lean_module._direct_product
    arms = (
        ("usual executor calls", lambda: setattr(lean_module, "_direct_product", _no_product)),
        ("direct products", lambda: setattr(lean_module, "_direct_product", bound)),
    )
    try:
        return alternate(args, engine, args.product_ab, arms)
    finally:
        lean_module._direct_product = bound


def _no_product(cell, modules, executor):
    return None


def layer_ops_ab(args, engine) -> list[tuple[str, float]]:
    """PyTorch's norms and rotary against symbiont's kernels (symbiont/serve/layer_ops.py):
    decode steps, then the prefill of one more prompt of `--prompt-len` tokens per arm and
    round (each prompt new, so no step reuses another's KV)."""
    lean = engine.runner.lean
    if lean is None or lean.ops is None:
        from symbiont.serve import decode_kernel

        why = decode_kernel.unavailable_reason() or "no lean forward for this architecture"
        raise SystemExit(f"{args.model}: no layer kernels here ({why})")
    ops = lean.ops
    arms = (
        ("PyTorch's operations", lambda: setattr(lean, "ops", None)),
        ("layer kernels", lambda: setattr(lean, "ops", ops)),
    )
    try:
        rows = [
            (f"{name}, decode step", ms)
            for name, ms in alternate(args, engine, args.layer_ops_ab, arms)
        ]
        for request in list(engine.requests):
            engine.abort(request)
        prefill_s = defaultdict(float)
        gen = torch.Generator().manual_seed(args.seed + 1)
        for round_ in range(args.layer_ops_ab):
            for name, apply in arms if round_ % 2 == 0 else arms[::-1]:
                apply()
                prompt = torch.randint(
                    10, engine.runner.vocab_size, (args.prompt_len,), generator=gen
                )
                prefill_s[name] += _one_prefill(engine, prompt.tolist(), f"prefill-{round_}-{name}")
        rows += [
            (
                f"{name}, prefill of {args.prompt_len} tokens",
                prefill_s[name] * 1000 / args.layer_ops_ab,
            )
            for name, _ in arms
        ]
        return rows
    finally:
        lean.ops = ops


def _one_prefill(engine, prompt: list[int], request_id: str) -> float:
    """Seconds from a lone request's admission to its first token (max_tokens 1)."""
    from symbiont.decoding import SamplingParams
    from symbiont.serve.sequence import Request

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request(Request(request_id, prompt, None, params))
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    return time.perf_counter() - start


def print_ab(args, model: str, engine, rows, what: str, rounds: int, per: int | None = None) -> int:
    print(
        f"model {model}: {args.batch} sequences decoding, prompts {args.prompt_len} tokens, "
        f"{args.threads} thread(s), {rounds} rounds of {args.steps} steps per setting\n"
    )
    unit, ratio = ("ms/step", rows[0][0]) if per is None else ("ms", "the pair's first")
    print(f"| {what} | {unit} | {ratio} / this |\n|---|---:|---:|")
    arms = len(rows) if per is None else per
    for i, (name, step) in enumerate(rows):  # each group of `arms` rows against its first
        print(f"| {name} | {step:.2f} | {rows[i - i % arms][1] / step:.3f}x |")
    with contextlib.suppress(Exception):
        engine.close()
    return 0


def _vocab(model: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model).vocab_size


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="default", help="checkpoint folder, or 'default'")
    p.add_argument("--batch", type=int, default=32, help="sequences decoding together")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=48, help="decode steps timed")
    p.add_argument("--profile-steps", type=int, default=16, help="decode steps profiled")
    p.add_argument("--max-batched-tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prepack",
        action="store_true",
        help="base weights packed for oneDNN, as `symbiont serve` runs by default",
    )
    p.add_argument(
        "--sdpa",
        action="store_true",
        help="decode attention through PyTorch's SDPA, as before symbiont's CPU kernel "
        "(symbiont serve --no-decode-kernel)",
    )
    p.add_argument("--json", help="also write the breakdown here")
    p.add_argument(
        "--fusion-ab",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="instead: time decode steps with and without fused q/k/v and gate/up calls",
    )
    p.add_argument(
        "--lean-ab",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="instead: time decode steps with transformers' forward and the lean one",
    )
    p.add_argument(
        "--kernel-ab",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="instead: time decode steps with PyTorch's SDPA and symbiont's decode kernel",
    )
    p.add_argument(
        "--layer-ops-ab",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="instead: time decode steps, then one prompt's prefill, with PyTorch's norms "
        "and rotary and with symbiont's layer kernels",
    )
    p.add_argument(
        "--direct-ab",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="instead: time decode steps with the lean forward calling its projection "
        "modules and calling the executor directly",
    )
    p.add_argument(
        "--product-ab",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="instead (with --prepack): time decode steps with the lean forward's executor "
        "calls made as usual calls and through products bound to each projection once",
    )
    args = p.parse_args(argv)
    args.max_tokens = args.steps + args.profile_steps + 8
    if args.fusion_ab:
        args.max_tokens = (args.steps + 1) * args.fusion_ab * len(FUSION_ARMS) + 8
    abs_ = (args.lean_ab, args.kernel_ab, args.layer_ops_ab, args.direct_ab, args.product_ab)
    if any(abs_):
        rounds = sum(abs_)
        args.max_tokens = (args.steps + 1) * rounds * 2 + 8
    torch.set_num_threads(args.threads)

    import symbiont
    from symbiont.serve import EngineConfig
    from symbiont.serve.engine import Engine

    model = str(symbiont.default_model()) if args.model == "default" else args.model
    config = EngineConfig(
        max_running=args.batch,
        max_batched_tokens=args.max_batched_tokens,
        max_queue=args.batch,
        decode_kernel=not args.sdpa,
    )
    from symbiont.tenant import open_executor

    executor = open_executor(model, prepack=args.prepack)
    engine = Engine.from_pretrained(model, config=config, executor=executor)
    if args.fusion_ab:
        return print_fusion_ab(args, model, engine)
    if args.lean_ab:
        return print_ab(args, model, engine, lean_ab(args, engine), "forward", args.lean_ab)
    if args.kernel_ab:
        rows = kernel_ab(args, engine)
        return print_ab(args, model, engine, rows, "decode attention", args.kernel_ab)
    if args.direct_ab:
        rows = direct_ab(args, engine)
        return print_ab(args, model, engine, rows, "projections", args.direct_ab)
    if args.product_ab:
        rows = product_ab(args, engine)
        return print_ab(args, model, engine, rows, "executor calls", args.product_ab)
    if args.layer_ops_ab:
        rows = layer_ops_ab(args, engine)
        return print_ab(args, model, engine, rows, "norms and rotary", args.layer_ops_ab, per=2)
    phases, sequences, _ = engine_phases(args, engine)
    split = forward_split(args, engine)
    outside, inside, http_steps = http_cost(args, model)

    step = phases["step"]
    rows = []
    forward = phases.get("forward", 0.0)
    for name in ("matmul", "attention", "other tensor ops", "python overhead"):
        rows.append((f"forward: {name}", forward * split.get(name, 0.0)))
    rows.append(("sampling (+ logprob pick)", phases.get("sampling", 0.0)))
    detok = phases.get("detokenisation", 0.0)
    rows.append(("output processing (stop rule, bookkeeping)", phases["output processing"] - detok))
    rows.append(("detokenisation", detok))
    rows.append(("scheduling", phases.get("scheduling", 0.0)))
    rows.append(("batch preparation", phases.get("batch preparation", 0.0)))
    accounted = sum(
        phases.get(k, 0.0)
        for k in ("forward", "sampling", "output processing", "scheduling", "batch preparation")
    )
    rows.append(("step, other (Python in Engine.step)", step - accounted))
    rows.append(("HTTP server + hand-off (outside Engine.step)", outside))
    total = step + outside
    print(
        f"model {model}: {sequences} sequences decoding, prompts {args.prompt_len} tokens, "
        f"{args.threads} thread(s), {args.steps} steps timed, {args.profile_steps} profiled; "
        f"HTTP over {http_steps} steps (Engine.step there {inside:.2f} ms/step)\n"
    )
    print("| part of a decode step | ms/step | % |\n|---|---:|---:|")
    for name, ms in rows:
        print(f"| {name} | {ms:.2f} | {100 * ms / total:.1f}% |")
    print(f"| **total (engine step {step:.2f} + HTTP {outside:.2f})** | {total:.2f} | 100% |")
    print(f"\nengine-only decode: {sequences * 1000 / step:.0f} tokens/s")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": rows, "step_ms": step, "http_ms": outside}, out, indent=1)
    with contextlib.suppress(Exception):
        engine.close()
    return 0


def print_fusion_ab(args, model: str, engine) -> int:
    rows = fusion_ab(args, engine)
    print(
        f"model {model}: {args.batch} sequences decoding, prompts {args.prompt_len} tokens, "
        f"{args.threads} thread(s), {args.fusion_ab} rounds of {args.steps} steps per setting\n"
    )
    print("| forward setting | ms/step | ms/forward | step vs first |\n|---|---:|---:|---:|")
    first = rows[0][1]
    for name, step, fwd in rows:
        print(f"| {name} | {step:.2f} | {fwd:.2f} | {step / first:.3f}x |")
    with contextlib.suppress(Exception):
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
