"""Per-call cost of each transport against the in-process executor.

A decode step makes one executor call per frozen linear layer with one token, so the
round trip of a one-token call decides decode latency. This starts one `serve-base`
process on a checkpoint with 512x512 projections and times one-token forward calls
(and a 64-token call) through every transport, printing each as a ratio of in-process.

    python benchmarks/transport_overhead.py [--calls 3000]

With `--device cuda` the executor (in-process and serve-base) computes on the GPU and x
lives there too; the shared-memory transports are then host areas (x and y cross PCIe,
as for a client on another GPU or mode='shm' without device) and CUDA IPC (the areas
on the GPU both share: symbiont.protocol.gpu_areas).

    python benchmarks/transport_overhead.py --device cuda --hidden 4096 --tokens 1,64,512

The row `cuda-ipc-wait` goes through a second serve-base started with
SYMBIONT_GPU_EVENTS=0: its GPU areas are ordered by each side waiting for its copies, as
before session 20, instead of by an event (symbiont.protocol.gpu_areas).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import symbiont
from symbiont.processes import ServerProcess


def build_checkpoint(folder: Path, hidden: int) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=256,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def time_calls(executor, layer: int, x: torch.Tensor, calls: int) -> float:
    """Median of 5 rounds of the mean seconds per call."""
    for _ in range(200):
        executor.forward(layer, x)
    rounds = []
    for _ in range(5):
        _sync(x)
        start = time.perf_counter()
        for _ in range(calls // 5):
            executor.forward(layer, x)
        _sync(x)
        rounds.append((time.perf_counter() - start) / (calls // 5))
    return statistics.median(rounds)


def _sync(x: torch.Tensor) -> None:
    if x.is_cuda:  # queued kernels count: in-process calls return before they ran
        torch.cuda.synchronize(x.device)


EXPECTED = {"tcp": "zmq", "ipc": "zmq", "cuda-ipc-wait": "cuda-ipc"}  # each row's transport


@contextlib.contextmanager
def _waiting_server(folder: Path, serve_args: tuple):
    """A serve-base whose GPU areas go without events (it reads the variable at start)."""
    before = os.environ.get("SYMBIONT_GPU_EVENTS")
    os.environ["SYMBIONT_GPU_EVENTS"] = "0"
    try:
        server = ServerProcess(folder, args=serve_args).start()
    finally:
        if before is None:
            del os.environ["SYMBIONT_GPU_EVENTS"]
        else:
            os.environ["SYMBIONT_GPU_EVENTS"] = before
    try:
        yield server
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", default="1,64", help="tokens per call, comma-separated")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on both sides")
    parser.add_argument("--device", default="cpu", help="where the executor computes (cpu, cuda)")
    parser.add_argument(
        "--transports", default=None, help="only these rows, comma-separated (default: all)"
    )
    args = parser.parse_args()
    if args.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: this machine or torch build has no CUDA GPU")
    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    folder = build_checkpoint(Path(tempfile.mkdtemp()) / "base", args.hidden)
    local = symbiont.BaseExecutor.from_pretrained(folder, device=args.device)
    layer = local.manifest.layer_ids()["model.layers.0.self_attn.q_proj"]
    where = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    print(
        f"layer {args.hidden}x{args.hidden}, fp32, {args.calls} calls, torch threads "
        f"{args.threads}, executor and x on {where}"
    )
    print(f"{'transport':<14} {'tokens':>6} {'µs/call':>9} {'vs in-process':>14}")
    serve_args = ("--threads", args.threads, "--device", args.device)
    wanted = set(args.transports.split(",")) if args.transports else None
    on_gpu = args.device != "cpu"
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(ServerProcess(folder, args=serve_args))
        waiting = None
        if on_gpu and (wanted is None or "cuda-ipc-wait" in wanted):
            waiting = stack.enter_context(_waiting_server(folder, serve_args))
        transports = {
            "in-process": lambda: local,
            "tcp": lambda: symbiont.connect(server.url("tcp"), mode="zmq"),
            "ipc": lambda: symbiont.connect(server.url("ipc"), mode="zmq"),
            "shm": lambda: symbiont.connect(server.url("ipc"), mode="shm"),
        }
        if on_gpu:
            transports["cuda-ipc"] = lambda: symbiont.connect(
                server.url("ipc"), mode="shm", device=args.device
            )
        if waiting is not None:
            transports["cuda-ipc-wait"] = lambda: symbiont.connect(
                waiting.url("ipc"), mode="shm", device=args.device
            )
        if wanted is not None:
            keep = {"in-process", *wanted}
            transports = {k: v for k, v in transports.items() if k in keep}
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, args.hidden, device=args.device)
            baseline = None
            for name, open_executor in transports.items():
                executor = open_executor()
                got = getattr(executor, "transport", name)
                if got != EXPECTED.get(name, name):  # e.g. no CUDA IPC: say so, not a figure
                    raise SystemExit(f"{name}: the client's transport is {got}")
                seconds = time_calls(executor, layer, x, args.calls)
                baseline = baseline or seconds
                print(f"{name:<14} {tokens:>6} {seconds * 1e6:>9.1f} {seconds / baseline:>13.1f}x")
                if executor is not local:
                    executor.close()


if __name__ == "__main__":
    main()
