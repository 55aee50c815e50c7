"""The base executor's linear layers on a CUDA GPU against their memory roofline.

    python benchmarks/gpu_roofline.py                      # 500m model, bfloat16 and float32
    python benchmarks/gpu_roofline.py --model 100m --dtype bfloat16 --rows 1,16 --out r.json

The target: a forward call takes at most 1.3x (bytes it moves / memory bandwidth).

Method, all in one run on one GPU:

1. Bandwidth: a device-to-device copy of a 1 GiB tensor (`dst.copy_(src)`, 2 GiB moved:
   read + write), median of a few repeats timed with CUDA events. The spec figure of the
   card (H100 SXM 3.35 TB/s, H200 4.8 TB/s, ...) is printed too when its name is known.
2. Peak compute per dtype: a large square matmul (8192) in that dtype. float32 runs with
   TF32 off (`torch.backends.cuda.matmul.allow_tf32 = False`), so it is true fp32.
3. The model: a random Llama of `benchmarks/peers/vllm_cpu.py`'s SIZES ('small', '100m',
   '500m'), or two decoder layers of Llama-2-7B's shapes ('7b-layers'), the same config as its `sized_checkpoint`, written to --work and loaded with
   `symbiont.BaseExecutor.from_pretrained(dir, device="cuda", dtype=...)`. It is built
   here without `sized_checkpoint` itself: that one takes its tokenizer and vocabulary
   from the default model, which a fresh machine first pretrains (about 50 s on CPU); the
   executor needs no tokenizer, and the vocabulary is the default model's spec (2048).
4. Calls, with x [rows, in] already on the GPU, under `torch.no_grad()`:
   - per distinct layer shape of the manifest (e.g. q_proj/o_proj 1280x1280, 56 layers):
     `executor.call(Op.FORWARD, layer, x)` on each layer of that shape in turn, so the
     weights swept are as large as the model makes them (a single layer called again and
     again would be read from L2 cache, not memory; the `L2` column marks sweeps whose
     weights fit in L2 all the same);
   - the fused calls a client makes (q/k/v, gate/up): `executor.forward_fused(ids, x)`;
   - one whole decode step: every layer once (`step`), and with q/k/v and gate/up fused
     (`step fused`), as a client of an in-process executor calls them.
   Each is timed three ways: `exec` (the executor's call, what a client pays), `raw`
   (`F.linear(x, w, b)` on the executor's own weight tensors, the same sweep: the
   difference is the executor's own overhead) and `graph` (the raw sweep replayed as one
   CUDA graph: GPU time without Python or launch overhead). Times are per call (per step
   for the decode steps): the median over --repeats repeats of about --iters calls each,
   after one repeat of warm-up, timed with CUDA events.
5. Bytes per call = weight (out*in, + bias) + x (rows*in) + y (rows*out), times the
   dtype's size; the memory roofline is bytes / measured copy bandwidth (and / spec
   bandwidth); the compute roofline is 2*rows*in*out flops / the measured peak. `t/roof`
   is time / max(memory roofline, compute roofline); `ok` says whether it is <= 1.3.

Without CUDA it prints one `skipped:` line and exits 0. The hidden `--device cpu` runs the
same code on the CPU with `time.perf_counter` (no graphs) as a smoke test:
`python benchmarks/gpu_roofline.py --device cpu --model small --rows 1,16 --iters 20 --repeats 2`.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402, N812 - torch's own alias

SKIP_LINE = "skipped: needs a CUDA GPU (torch.cuda.is_available() is False)"
TARGET = 1.3  # time <= TARGET x roofline
MODELS = ("small", "100m", "500m", "7b-layers")  # vllm_cpu.py's SIZES, and LAYER_SIZES
# Layers of a size a GPU is bought for: Llama-2-7B's shapes (hidden 4096, MLP 11008, 32
# heads), two decoder layers of them (the roofline is per layer; 32 add nothing but time
# to build). The 0.5B model's layers take 1-6 us at the memory roofline of an H100, less
# than one kernel launch.
LAYER_SIZES = {"7b-layers": (4096, 11008, 2, 32, 32)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_DTYPES = ("bfloat16", "float32")
# Spec memory bandwidth (bytes/s) by device name: every word of a key must be in the name
# (upper case); the first match wins, so the more specific names come first.
SPEC_BANDWIDTH = (
    (("H200",), 4.8e12),
    (("H100", "PCIE"), 2.0e12),
    (("H100", "NVL"), 3.9e12),
    (("H100",), 3.35e12),  # SXM, "NVIDIA H100 80GB HBM3"
    (("A100", "80GB", "PCIE"), 1.935e12),
    (("A100", "80GB"), 2.039e12),
    (("A100",), 1.555e12),
)
# Sibling layers a client feeds one input, fused into one executor call (leaf names).
FUSED_SETS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
COPY_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}  # source tensor of the bandwidth copy
MATMUL_N = {"cuda": 8192, "cpu": 512}  # square matmul for the peak flops


# --------------------------------------------------------------------------- accounting


@dataclass(frozen=True)
class Call:
    """One forward call: weight [out, in] (+ bias [out]) on x [rows, in] -> y [rows, out].
    A fused call's out_features is the sum over its layers."""

    layers: tuple[int, ...]  # executor layer ids: one, or a fused run
    in_features: int
    out_features: int
    has_bias: bool

    def weight_bytes(self, itemsize: int) -> int:
        bias = self.out_features if self.has_bias else 0
        return (self.out_features * self.in_features + bias) * itemsize

    def bytes(self, rows: int, itemsize: int) -> int:
        """Bytes moved: the weight (and bias) read once, x read, y written."""
        activations = rows * (self.in_features + self.out_features) * itemsize
        return self.weight_bytes(itemsize) + activations

    def flops(self, rows: int) -> int:
        return 2 * rows * self.in_features * self.out_features


@dataclass(frozen=True)
class Sweep:
    """Calls timed back to back; figures are reported per `unit` (per call, or per step)."""

    name: str
    calls: tuple[Call, ...]
    per_step: bool = False  # report the whole sweep (a decode step), not per call

    @property
    def unit(self) -> int:
        return 1 if self.per_step else len(self.calls)

    def bytes(self, rows: int, itemsize: int) -> int:
        return sum(c.bytes(rows, itemsize) for c in self.calls)

    def weight_bytes(self, itemsize: int) -> int:
        return sum(c.weight_bytes(itemsize) for c in self.calls)

    def flops(self, rows: int) -> int:
        return sum(c.flops(rows) for c in self.calls)


def leaf(name: str) -> str:
    return name.rpartition(".")[2]


def parent(name: str) -> str:
    return name.rpartition(".")[0]


def shape_sweeps(layers) -> list[Sweep]:
    """One sweep per distinct (in, out, bias) of the manifest's layers, largest first."""
    groups: dict[tuple[int, int, bool], list] = {}
    for spec in layers:
        key = (spec.in_features, spec.out_features, spec.has_bias)
        groups.setdefault(key, []).append(spec)
    sweeps = []
    for (n_in, n_out, bias), specs in groups.items():
        names = "/".join(dict.fromkeys(leaf(s.name) for s in specs))
        calls = tuple(Call((s.id,), n_in, n_out, bias) for s in specs)
        sweeps.append(Sweep(f"{names} {n_out}x{n_in}", calls))
    return sorted(sweeps, key=lambda s: -s.calls[0].weight_bytes(1))


def fused_calls(layers, runs) -> list[Call]:
    """The FUSED_SETS present in the manifest whose ids the executor runs as one matmul
    (`runs`: the fused layer-id tuples it knows), in manifest order."""
    by_parent: dict[str, dict[str, object]] = {}
    for spec in layers:
        by_parent.setdefault(parent(spec.name), {})[leaf(spec.name)] = spec
    calls = []
    for siblings in by_parent.values():
        for names in FUSED_SETS:
            specs = [siblings.get(n) for n in names]
            if None in specs:
                continue
            ids = tuple(s.id for s in specs)
            if ids in runs:
                out = sum(s.out_features for s in specs)
                calls.append(Call(ids, specs[0].in_features, out, specs[0].has_bias))
    return sorted(calls, key=lambda c: c.layers)


def fused_sweeps(calls: list[Call], layers) -> list[Sweep]:
    """One sweep per fused set (q/k/v, gate/up) over all transformer layers."""
    groups: dict[tuple[str, ...], list[Call]] = {}
    for call in calls:
        groups.setdefault(tuple(leaf(layers[i].name) for i in call.layers), []).append(call)
    return [
        Sweep(f"fused {'/'.join(names)} {c[0].out_features}x{c[0].in_features}", tuple(c))
        for names, c in groups.items()
    ]


def step_sweeps(layers, fused: list[Call]) -> list[Sweep]:
    """A whole decode step: every layer once; and with the fused sets as one call each."""
    single = tuple(Call((s.id,), s.in_features, s.out_features, s.has_bias) for s in layers)
    sweeps = [Sweep("step (all layers)", single, per_step=True)]
    if fused:
        first = {c.layers[0]: c for c in fused}  # a fused call takes its first layer's place
        covered = {i for c in fused for i in c.layers}
        mixed = []
        for call in single:
            layer = call.layers[0]
            if layer in first:
                mixed.append(first[layer])
            elif layer not in covered:
                mixed.append(call)
        sweeps.append(Sweep("step fused", tuple(mixed), per_step=True))
    return sweeps


def spec_bandwidth(device_name: str) -> float | None:
    """The card's spec memory bandwidth in bytes/s, or None when the name is not known."""
    name = device_name.upper()
    for words, bandwidth in SPEC_BANDWIDTH:
        if all(w in name for w in words):
            return bandwidth
    return None


def figures(sweep: Sweep, rows: int, itemsize: int, times: dict, machine: dict) -> dict:
    """One table row: times (s, per unit) against the rooflines of `machine`
    (bandwidth, spec_bandwidth, peak_flops, l2_bytes)."""
    unit = sweep.unit
    moved = sweep.bytes(rows, itemsize) / unit
    mem = moved / machine["bandwidth"]
    spec = moved / machine["spec_bandwidth"] if machine["spec_bandwidth"] else None
    compute = sweep.flops(rows) / unit / machine["peak_flops"]
    roof = max(mem, compute)
    l2 = machine["l2_bytes"]
    row = {
        "name": sweep.name,
        "rows": rows,
        "calls": len(sweep.calls),
        "per_step": sweep.per_step,
        "bytes": moved,
        "flops": sweep.flops(rows) / unit,
        "swept_weight_bytes": sweep.weight_bytes(itemsize),
        "fits_l2": bool(l2) and sweep.weight_bytes(itemsize) <= l2,
        "mem_roofline_s": mem,
        "spec_roofline_s": spec,
        "compute_roofline_s": compute,
        "roofline_s": roof,
        **{f"{k}_s": v for k, v in times.items()},
    }
    exec_s = times["exec"]
    row["ratio_mem"] = exec_s / mem
    row["ratio_spec"] = exec_s / spec if spec else None
    row["ratio_roof"] = exec_s / roof
    row["ok"] = row["ratio_roof"] <= TARGET
    row["graph_ratio_roof"] = times["graph"] / roof if times.get("graph") else None
    return row


# --------------------------------------------------------------------------- table

COLUMNS = (  # header, width, row -> text
    ("call", 0, lambda r: r["name"]),  # width: the longest name
    ("rows", 5, lambda r: str(r["rows"])),
    ("n", 4, lambda r: str(r["calls"])),
    ("KB", 9, lambda r: f"{r['bytes'] / 1e3:.1f}"),
    ("exec us", 9, lambda r: _us(r["exec_s"])),
    ("raw us", 9, lambda r: _us(r["raw_s"])),
    ("graph us", 9, lambda r: _us(r.get("graph_s"))),
    ("mem us", 9, lambda r: _us(r["mem_roofline_s"])),
    ("cmp us", 9, lambda r: _us(r["compute_roofline_s"])),
    ("t/mem", 7, lambda r: _ratio(r["ratio_mem"])),
    ("t/spec", 7, lambda r: _ratio(r["ratio_spec"])),
    ("t/roof", 7, lambda r: _ratio(r["ratio_roof"])),
    ("ok", 3, lambda r: "yes" if r["ok"] else "no"),
    ("g/roof", 7, lambda r: _ratio(r["graph_ratio_roof"])),
    ("L2", 2, lambda r: "L2" if r["fits_l2"] else ""),
)


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.2f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(rows: list[dict]) -> str:
    """The rows as a fixed-width text table (the first column as wide as its longest name)."""
    first = max([len(COLUMNS[0][0])] + [len(r["name"]) for r in rows])
    widths = [first] + [w for _, w, _ in COLUMNS[1:]]

    def line(cells) -> str:
        return " ".join(
            f"{c:<{w}}" if i == 0 else f"{c:>{w}}"
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    header = line([h for h, _, _ in COLUMNS])
    return "\n".join([header] + [line([f(r) for _, _, f in COLUMNS]) for r in rows])


LEGEND = (
    "us: per call (per step for `step` rows). exec: executor.call/forward_fused; raw: "
    "F.linear on its weights; graph: raw sweep as one CUDA graph. mem/cmp: memory roofline "
    "(bytes / measured copy bandwidth) and compute roofline (flops / measured peak). t/mem, "
    "t/spec: exec time / memory roofline at measured and spec bandwidth; t/roof: exec / "
    f"max(mem, cmp); ok: t/roof <= {TARGET}; g/roof: graph / max(mem, cmp); L2: the swept "
    "weights fit in L2 cache (repeats may read them from L2, not memory)."
)


# --------------------------------------------------------------------------- timing


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def elapsed(fn: Callable[[], object], n: int, device: torch.device) -> float:
    """Seconds for n back-to-back fn() calls: CUDA events on a GPU, else perf_counter."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    synchronize(device)
    begin = time.perf_counter()
    for _ in range(n):
        fn()
    return time.perf_counter() - begin


def seconds_per(fn: Callable[[], object], n: int, repeats: int, device: torch.device) -> float:
    """Median over `repeats` of the time of one fn() (each repeat n calls), after one
    repeat's worth of warm-up."""
    for _ in range(n):
        fn()
    synchronize(device)
    return statistics.median(elapsed(fn, n, device) / n for _ in range(max(1, repeats)))


def copy_bandwidth(device: torch.device, repeats: int) -> float:
    """Achievable memory bandwidth (bytes/s): read + write of a large device copy."""
    size = COPY_BYTES[device.type]
    src = torch.empty(size // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = seconds_per(lambda: dst.copy_(src), 5, repeats, device)
    return 2 * size / seconds


def peak_flops(dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    """Measured matmul throughput (flop/s) of a large square matmul in `dtype`."""
    n = MATMUL_N[device.type]
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = seconds_per(lambda: torch.mm(a, b), 3, repeats, device)
    return 2 * n**3 / seconds


def cuda_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """fn captured as one CUDA graph, after warm-up on a side stream (as torch's docs do)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


# --------------------------------------------------------------------------- executor


def raw_weights(executor, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The executor's own weight (and bias) tensors of one call: a layer's, or the
    block rows of a fused run (BaseExecutor internals: `_weights`, `_runs`)."""
    if len(layers) == 1:
        w = executor._weights[layers[0]]
        return w.weight, w.bias
    run = executor._runs[layers]
    return run.weight, run.bias


def sweep_fns(executor, sweep: Sweep, xs: dict[int, torch.Tensor]):
    """(executor sweep, raw F.linear sweep): each makes every call of `sweep` once."""
    from symbiont.protocol.executor import Op

    steps, raws = [], []
    for call in sweep.calls:
        x = xs[call.in_features]
        if len(call.layers) == 1:
            steps.append((executor.call, (Op.FORWARD, call.layers[0], x)))
        else:
            steps.append((executor.forward_fused, (call.layers, x)))
        raws.append((x, *raw_weights(executor, call.layers)))

    def run_executor():
        for fn, args in steps:
            fn(*args)

    def run_raw():
        for x, w, b in raws:
            F.linear(x, w, b)

    return run_executor, run_raw


class GraphTimer:
    """Times a sweep as one CUDA graph; after one failure it stops trying (says why once)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def seconds(self, fn, n: int, repeats: int, device: torch.device) -> float | None:
        if not self.enabled or device.type != "cuda":
            return None
        try:
            graph = cuda_graph(fn)
            seconds = seconds_per(graph.replay, n, repeats, device)
            del graph
            return seconds
        except Exception as err:  # a broken capture must not end the run
            self.enabled = False
            print(f"note: CUDA graph timing off for the rest of the run: {err!r}", flush=True)
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(device)
            return None


def measure_dtype(executor, rows_list, args, machine, device, graphs: GraphTimer) -> list[dict]:
    """Every sweep of the model at every row count -> table rows."""
    manifest = executor.manifest
    layers = manifest.layers
    fused = fused_calls(layers, executor._runs)
    sweeps = shape_sweeps(layers) + fused_sweeps(fused, layers) + step_sweeps(layers, fused)
    dtype, itemsize = manifest.dtype, manifest.dtype.itemsize
    widths = sorted({s.in_features for s in layers})
    rows_out = []
    for rows in rows_list:
        xs = {w: torch.randn(rows, w, device=device).to(dtype) for w in widths}
        for sweep in sweeps:
            n = max(3, math.ceil(args.iters / len(sweep.calls)))
            run_executor, run_raw = sweep_fns(executor, sweep, xs)
            times = {
                "exec": seconds_per(run_executor, n, args.repeats, device) / sweep.unit,
                "raw": seconds_per(run_raw, n, args.repeats, device) / sweep.unit,
            }
            graph = graphs.seconds(run_raw, n, args.repeats, device)
            times["graph"] = None if graph is None else graph / sweep.unit
            rows_out.append(figures(sweep, rows, itemsize, times, machine))
        del xs
    return rows_out


# --------------------------------------------------------------------------- checkpoint


def model_sizes() -> dict[str, tuple[int, ...]]:
    """`SIZES` of benchmarks/peers/vllm_cpu.py, read from its source (importing it needs
    httpx, a dev extra the GPU machine may lack)."""
    source = (REPO / "benchmarks" / "peers" / "vllm_cpu.py").read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "SIZES" for t in node.targets
        ):
            return ast.literal_eval(node.value) | LAYER_SIZES
    raise RuntimeError("benchmarks/peers/vllm_cpu.py has no SIZES")


def build_checkpoint(folder: Path, size: str, seed: int = 0) -> Path:
    """A random Llama of SIZES[size], configured as `sized_checkpoint` does, without the
    tokenizer (built once into `folder`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from symbiont.model.default import DefaultModelSpec

    if (folder / "config.json").exists():
        return folder
    hidden, mlp, n_layers, heads, kv_heads = model_sizes()[size]
    config = LlamaConfig(
        vocab_size=DefaultModelSpec().vocab_size,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


# --------------------------------------------------------------------------- main


def parse_rows(text: str) -> list[int]:
    rows = [int(t) for t in text.split(",") if t.strip()]
    if not rows or min(rows) < 1:
        raise argparse.ArgumentTypeError(f"--rows wants positive integers, got {text!r}")
    return rows


def parse_dtypes(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in DTYPES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"--dtype wants some of {', '.join(DTYPES)}")
    return names


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", choices=MODELS, default="500m", help="random Llama size (default 500m)"
    )
    parser.add_argument(
        "--dtype",
        type=parse_dtypes,
        default=list(DEFAULT_DTYPES),
        help="float32, bfloat16 or float16, or a comma list (default: bfloat16,float32)",
    )
    parser.add_argument(
        "--rows", type=parse_rows, default=[1, 16, 64, 256], help="tokens per call (1,16,64,256)"
    )
    parser.add_argument(
        "--iters", type=int, default=200, help="calls per timed repeat (default 200)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats, median (5)")
    parser.add_argument("--out", type=Path, help="write every figure to this JSON file")
    parser.add_argument(
        "--work", type=Path, help="folder for the checkpoint (default: a temporary one)"
    )
    parser.add_argument(
        "--no-graph", action="store_true", help="skip the CUDA graph timing of the raw sweeps"
    )
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: smoke test
    return parser.parse_args(argv)


def machine_figures(device: torch.device, repeats: int) -> dict:
    """Device name, spec and measured bandwidth, L2 size."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, l2 = props.name, getattr(props, "L2_cache_size", None)
    else:
        name, l2 = "cpu", None
    return {
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "spec_bandwidth": spec_bandwidth(name) if device.type == "cuda" else None,
        "bandwidth": copy_bandwidth(device, repeats),
        "l2_bytes": l2,
    }


def print_machine(machine: dict) -> None:
    spec = machine["spec_bandwidth"]
    spec_text = f"{spec / 1e12:.2f} TB/s" if spec else "unknown"
    l2 = machine["l2_bytes"]
    l2_text = f"L2 {l2 / 2**20:.0f} MiB" if l2 else "L2 unknown"
    print(
        f"device: {machine['device']} (torch {machine['torch']}, CUDA {machine['cuda']}); "
        + l2_text
    )
    print(
        f"memory bandwidth: measured {machine['bandwidth'] / 1e12:.3f} TB/s "
        f"(device copy, read + write); spec {spec_text}",
        flush=True,
    )


def run_dtype(name, folder, args, machine, device, graphs) -> tuple[dict, list[dict]]:
    """Load the executor in dtype `name`, measure its peak flops and every sweep."""
    import symbiont

    dtype = DTYPES[name]
    flops = peak_flops(dtype, device, args.repeats)
    started = time.perf_counter()
    executor = symbiont.BaseExecutor.from_pretrained(folder, device=str(device), dtype=dtype)
    load_s = time.perf_counter() - started
    info = {
        "dtype": name,
        "peak_flops": flops,
        "load_s": load_s,
        "weight_bytes": executor.weight_bytes(),
        "tf32": torch.backends.cuda.matmul.allow_tf32 if dtype == torch.float32 else None,
    }
    tf32 = ""
    if dtype == torch.float32:  # read back: what the matmuls below really ran with
        tf32 = f", TF32 {'ON' if info['tf32'] else 'off'} (allow_tf32 = {info['tf32']})"
    print(
        f"\n== {name}{tf32}: peak {flops / 1e12:.4g} TFLOP/s (matmul "
        f"{MATMUL_N[device.type]}); weights {info['weight_bytes'] / 1e6:.1f} MB, "
        f"loaded in {load_s:.1f} s",
        flush=True,
    )
    with torch.no_grad():
        rows = measure_dtype(
            executor, args.rows, args, {**machine, "peak_flops": flops}, device, graphs
        )
    for row in rows:
        row["dtype"] = name
    print(format_table(rows), flush=True)
    del executor
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return info, rows


def summary(rows: list[dict]) -> list[str]:
    """One line per dtype and row count: the decode step against its roofline."""
    lines = []
    for row in rows:
        if row["per_step"]:
            verdict = "meets" if row["ok"] else "misses"
            lines.append(
                f"{row['dtype']:>8} {row['name']:<17} rows {row['rows']:>4}: "
                f"{row['exec_s'] * 1e6:9.1f} us vs roofline {row['roofline_s'] * 1e6:8.1f} us"
                f" = {row['ratio_roof']:.2f}x, {verdict} <= {TARGET}x"
            )
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(SKIP_LINE)
        return 0
    started = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 is fp32; bf16/fp16 unaffected
    with tempfile.TemporaryDirectory(prefix="gpu-roofline-") as tmp:
        work = args.work or Path(tmp)
        t = time.perf_counter()
        folder = build_checkpoint(work / f"llama-{args.model}", args.model)
        print(f"model {args.model}: {folder} (ready in {time.perf_counter() - t:.1f} s)")
        machine = machine_figures(device, args.repeats)
        print_machine(machine)
        graphs = GraphTimer(enabled=not args.no_graph)
        infos, rows = [], []
        for name in args.dtype:
            info, dtype_rows = run_dtype(name, folder, args, machine, device, graphs)
            infos.append(info)
            rows += dtype_rows
    print("\n" + LEGEND)
    print(
        "\n".join(["", "decode step (exec) against max(memory, compute) roofline:"] + summary(rows))
    )
    total = time.perf_counter() - started
    print(f"\ntotal {total:.1f} s")
    if args.out:
        report = {"args": vars(args), "machine": machine, "dtypes": infos, "rows": rows}
        report["total_s"] = total
        args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
