"""Configuration of `symbiont serve`: the engine's capacity (`EngineConfig`) and the
server around it (`ServerConfig`); frozen, validated dataclasses whose fields are also the
command's flags (help text in their metadata, read by `symbiont.cli.flags`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from symbiont.protocol.urls import is_loopback

MAX_ADAPTER_SLOTS = 4096  # --max-loras beyond this allocated gigabytes of empty stacks


LORA_DTYPES = ("float32", "bfloat16")  # --lora-dtype


class CachePolicy(StrEnum):
    """Which cached adapter leaves a tier first (`symbiont.serve.adapter_cache`)."""

    COST = "cost"  # Chameleon: lowest F*frequency + R*recency + S*size
    LRU = "lru"  # least recently used


class DeltaMode(StrEnum):
    """How a compressed delta is applied (`symbiont.serve.deltas`)."""

    EXACT = "exact"  # the packed 2:4 low-bit delta, decompressed at every call
    MERGED = "merged"  # "hot": Δ̃ decompressed once, dense; one matmul per call


class SchedulerPolicy(StrEnum):
    """Order in which waiting requests are admitted (`symbiont.serve.mlq`)."""

    FIFO = "fifo"  # arrival order
    MLQ = "mlq"  # Chameleon's multi-level queues by weighted request size


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Capacity and scheduling limits of one serving engine.

    Memory is preallocated at these maxima (adapter stacks, KV blocks), so raising them
    costs memory up front, never on the hot path.
    """

    max_running: int = field(default=32, metadata={"help": "sequences generated at once"})
    max_batched_tokens: int = field(
        default=256, metadata={"help": "tokens per iteration (decode + prefill chunks)"}
    )
    max_queue: int = field(
        default=256, metadata={"help": "waiting requests before new ones get HTTP 429"}
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV-cache block"})
    num_blocks: int = field(
        default=1024, metadata={"help": "KV-cache blocks shared by all sequences"}
    )
    max_adapters: int = field(
        default=32,
        metadata={
            "help": "adapters resident in the batched weight stacks at once (no adapter is "
            "extra); --adapter-dir adapters beyond it wait in host memory or on disk",
            "flag": "--max-loras",
            "aliases": ("--max-adapters",),
        },
    )
    max_lora_rank: int = field(
        default=64, metadata={"help": "largest LoRA rank served (lower ranks are zero-padded)"}
    )
    lora_dtype: str | None = field(
        default=None,
        metadata={
            "help": "dtype the served LoRA weights are held in (default: the model's). "
            "bfloat16 halves each resident adapter's memory and the bytes a decode step "
            "reads (on a CPU, 100 adapters then cost 9%% of base-only throughput, not "
            "12-17%%); exact for adapters saved in bfloat16 whose scale (alpha/r) is a power "
            "of two, others are rounded to bfloat16 (docs/serving.md)",
            "choices": LORA_DTYPES,
        },
    )
    slo_tpot_s: float | None = field(
        default=None,
        metadata={
            "help": "time-per-output-token target of co-serving (FlexLLM, docs/jobs.md): "
            "after each iteration, fine-tuning jobs of --jobs-dir run the most tokens a "
            "profiled cost model fits within it (default: jobs train beside inference, "
            "inference first per base call)",
            "flag": "--slo-tpot-ms",
            "scale": 1e-3,
        },
    )
    max_model_len: int | None = field(
        default=None,
        metadata={"help": "prompt + output tokens per sequence (default: the model's limit)"},
    )
    host_cache_bytes: int = field(
        default=0,
        metadata={
            "help": "bytes of --adapter-dir adapters kept in host memory, the host copies of "
            "resident ones included (0: follow idle memory, half of what the OS reports "
            "available, re-read on every load)"
        },
    )
    cache_policy: CachePolicy = field(
        default=CachePolicy.COST,
        metadata={
            "help": "eviction of --adapter-dir adapters: cost (Chameleon's score of frequency, "
            "recency and size) or lru"
        },
    )
    scheduler: SchedulerPolicy = field(
        default=SchedulerPolicy.FIFO,
        metadata={
            "help": "admission order: fifo, or mlq (Chameleon's queues by weighted request "
            "size: small requests first, large ones never starve)"
        },
    )
    mlq_slo_s: float = field(
        default=5.0,
        metadata={
            "help": "time-to-first-token objective the mlq queue quotas aim at",
            "flag": "--mlq-slo-ms",
            "scale": 1e-3,
        },
    )
    mlq_refresh_s: float = field(
        default=300.0,
        metadata={"help": "seconds between recomputing the mlq queues from recent requests"},
    )

    max_deltas: int | None = field(
        default=None,
        metadata={
            "help": "compressed deltas resident in slots at once (DeltaZip's N; each takes "
            "one of the --max-loras slots); requests for others wait until one is idle "
            "(default: no limit beyond --max-loras)"
        },
    )
    delta_mode: DeltaMode = field(
        default=DeltaMode.EXACT,
        metadata={
            "help": "how --adapter-dir deltas (and --delta ones without :MODE) are applied: "
            "exact (packed, decompressed per call) or merged (dense Δ̃ kept, one matmul)"
        },
    )
    max_skips: int = field(
        default=16,
        metadata={
            "help": "requests that may join the slot reserved for a request waiting for one "
            "(the slot that frees first) ahead of it (DeltaZip's skip-the-line; requests for "
            "other resident adapters start freely; 0: strict arrival order)"
        },
    )

    lean_forward: bool = field(
        default=True,
        metadata={
            "flag": "--no-lean-forward",
            "help": "run Llama, Mistral and Qwen2 checkpoints through transformers' own "
            "forward; by default the engine calls their submodules in a loop of its own "
            "without transformers' wrappers (same modules and results, less Python per "
            "step; symbiont/serve/lean.py)",
        },
    )
    decode_kernel: bool = field(
        default=True,
        metadata={
            "flag": "--no-decode-kernel",
            "help": "attention through PyTorch's SDPA; by default, in float32 on a CPU, "
            "decoding sequences and prefill chunks attend through symbiont's own kernels "
            "(1.8-2.8x and 2.0-2.5x faster per layer), compiled once with the machine's C++ "
            "compiler (g++ >= 12 or clang) and cached under $SYMBIONT_HOME/kernels; without "
            "a compiler, SDPA (symbiont/serve/decode_kernel.py)",
        },
    )
    layer_ops: bool = field(
        default=True,
        metadata={
            "flag": "--no-layer-ops",
            "help": "norms and rotary embedding through PyTorch's operations; by default, in "
            "float32 on a CPU, the lean forward runs each residual add with its RMSNorm, and "
            "the rotary embedding of queries and keys, in one pass each, through symbiont's "
            "CPU kernels (built with the decode kernel; results within float32 rounding; "
            "symbiont/serve/layer_ops.py)",
        },
    )

    def __post_init__(self) -> None:
        for name in (
            "max_running",
            "max_batched_tokens",
            "block_size",
            "num_blocks",
            "max_adapters",
            "max_lora_rank",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.host_cache_bytes < 0:
            raise ValueError(
                f"EngineConfig.host_cache_bytes must be >= 0 (0 follows idle memory), got "
                f"{self.host_cache_bytes}"
            )
        if self.max_adapters > MAX_ADAPTER_SLOTS:  # each slot holds a stack row per layer
            raise ValueError(
                f"--max-loras must be at most {MAX_ADAPTER_SLOTS}, got {self.max_adapters}"
            )
        for flag, seconds in (
            ("--mlq-slo-ms", self.mlq_slo_s),
            ("--mlq-refresh-s", self.mlq_refresh_s),
            ("--slo-tpot-ms", self.slo_tpot_s),
        ):
            # NaN passed `<= 0` and made MLQ run one request at a time; inf or NaN in the
            # co-serving SLO stopped the engine at the first job's slot
            if seconds is not None and not (math.isfinite(seconds) and 0 < seconds <= 3600):
                shown = seconds * 1e3 if flag.endswith("-ms") else seconds
                raise ValueError(f"{flag} must be a positive finite number, got {shown:g}")
        if self.lora_dtype is not None and self.lora_dtype not in LORA_DTYPES:
            raise ValueError(
                f"--lora-dtype must be one of {', '.join(LORA_DTYPES)}, got {self.lora_dtype!r}"
            )
        if self.max_deltas is not None and self.max_deltas < 1:
            raise ValueError(f"EngineConfig.max_deltas must be >= 1, got {self.max_deltas}")
        if self.max_skips < 0:
            raise ValueError(f"EngineConfig.max_skips must be >= 0, got {self.max_skips}")
        object.__setattr__(self, "delta_mode", DeltaMode(self.delta_mode))
        object.__setattr__(self, "cache_policy", CachePolicy(self.cache_policy))
        object.__setattr__(self, "scheduler", SchedulerPolicy(self.scheduler))
        if self.max_queue < 1:  # 0 would refuse every request
            raise ValueError(f"EngineConfig.max_queue must be >= 1, got {self.max_queue}")
        if self.max_batched_tokens < self.max_running:
            raise ValueError(
                f"EngineConfig.max_batched_tokens ({self.max_batched_tokens}) must be at least "
                f"max_running ({self.max_running}) so every running sequence can decode each "
                "iteration; raise max_batched_tokens or lower max_running"
            )

    @property
    def num_slots(self) -> int:
        """Adapter slots including slot 0, which means "no adapter"."""
        return self.max_adapters + 1

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


def parse_adapter(value: str) -> tuple[str, str]:
    """'NAME=PATH' -> (NAME, PATH), the form of `--adapter`."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--adapter {value!r}: expected NAME=PATH, e.g. sql=runs/sql-lora")
    return name, path


parse_adapter.__name__ = "NAME=PATH"


def parse_delta(value: str) -> tuple[str, str] | tuple[str, str, str]:
    """'NAME=DIR' -> (NAME, DIR); 'NAME=DIR:MODE' -> (NAME, DIR, MODE), the form of
    `--delta` (MODE: exact or merged)."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(
            f"--delta {value!r}: expected NAME=DIR or NAME=DIR:merged, e.g. chat=runs/chat-delta"
        )
    folder, colon, mode = path.rpartition(":")
    if colon and mode in tuple(DeltaMode):
        return name, folder, mode
    if colon and folder and "/" not in mode and not Path(path).expanduser().exists():
        modes = " or ".join(tuple(DeltaMode))
        raise ValueError(f"--delta {value!r}: unknown mode {mode!r}; write DIR:MODE with {modes}")
    return name, path


parse_delta.__name__ = "NAME=DIR[:MODE]"


@dataclass(frozen=True)
class ServerConfig:
    """The OpenAI-compatible server of `symbiont serve` around one engine.

    A server on a non-loopback host needs `api_key` (clients send `Authorization: Bearer
    KEY`) unless `allow_unauthenticated` says on purpose that anyone may use it. Clients
    may load adapters by path (`POST /v1/adapters`) only from under `adapter_dir`; request
    bodies over `max_request_bytes` are refused (413) and never held.
    """

    model: str = field(metadata={"help": "local Hugging Face checkpoint folder"})
    adapters: tuple[tuple[str, str], ...] = field(
        default=(),
        metadata={
            "help": "PEFT adapter folder to load under NAME (repeatable)",
            "flag": "--adapter",
            "metavar": "NAME=PATH",
            "type": parse_adapter,
        },
    )
    deltas: tuple[tuple[str, ...], ...] = field(
        default=(),
        metadata={
            "help": "compressed full fine-tune (`symbiont delta compress` folder) to serve "
            "under NAME, per request beside the adapters (repeatable; docs/deltas.md); "
            "DIR:merged keeps its Δ̃ decompressed (hot), DIR:exact (default: --delta-mode)",
            "flag": "--delta",
            "metavar": "NAME=DIR[:MODE]",
            "type": parse_delta,
        },
    )
    executor: str | None = field(
        default=None,
        metadata={
            "help": "URL of a base executor served elsewhere, e.g. tcp://127.0.0.1:7100 "
            "(default: load the base in this process)",
            "metavar": "URL",
        },
    )
    mask_activations: str | None = field(
        default=None,
        metadata={
            "help": "hide activations from the executor (docs/privacy.md): 'pool' masks every "
            "call; 'shares' splits every call between --executor and --second-executor, "
            "run by parties that do not collude (default: no masking)",
            "choices": ("pool", "shares"),
        },
    )
    second_executor: str | None = field(
        default=None,
        metadata={
            "help": "with --mask-activations shares: URL of the second party's base executor "
            "(the same checkpoint as --executor)",
            "metavar": "URL",
        },
    )
    executor_token: str | None = field(
        default=None,
        metadata={
            "help": "the --token of --executor's serve-base (default: $SYMBIONT_TOKEN)",
            "metavar": "TOKEN",
        },
    )
    second_executor_token: str | None = field(
        default=None,
        metadata={
            "help": "the --token of --second-executor's serve-base, the second party's own "
            "(default: $SYMBIONT_TOKEN)",
            "metavar": "TOKEN",
        },
    )
    host: str = field(default="127.0.0.1", metadata={"help": "interface to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on (0: any free port)"})
    api_key: str | None = field(
        default=None,
        metadata={"help": "require `Authorization: Bearer KEY` on /v1/ routes", "metavar": "KEY"},
    )
    allow_unauthenticated: bool = field(
        default=False,
        metadata={
            "help": "listen on a non-loopback --host without --api-key: anyone who reaches "
            "it may use the server (only on a network you trust)"
        },
    )
    max_request_bytes: int = field(
        default=8 * 1024 * 1024,
        metadata={
            "help": "largest request body in bytes; bigger ones get HTTP 413 (and are never held)"
        },
    )
    adapter_dir: str | None = field(
        default=None,
        metadata={
            "help": "folder of adapters: each subfolder holding a PEFT adapter is served under "
            "its folder name, loaded on first use; POST /v1/adapters may load only from under "
            "it (paths resolved, symlinks followed); without it, loads by path are refused",
            "metavar": "DIR",
        },
    )
    served_model_name: str | None = field(
        default=None,
        metadata={"help": "name of the base model in the API (default: the folder's name)"},
    )
    jobs_dir: str | None = field(
        default=None,
        metadata={
            "help": "folder of the fine-tuning jobs API (SQLite database, uploaded files, "
            "checkpoints); created if missing; without it, /v1/fine_tuning is off",
            "metavar": "DIR",
        },
    )
    tenants: str | None = field(
        default=None,
        metadata={
            "help": "JSON file of tenants (api_key, limits); every /v1/ request then needs a "
            "tenant's key, and tenants see only their own files, jobs and models",
            "metavar": "FILE",
        },
    )
    dtype: str | None = field(
        default=None,
        metadata={"help": "float32, bfloat16, float16 (default: the checkpoint's)"},
    )
    device: str = field(default="cpu", metadata={"help": "where the model runs (cpu, cuda)"})
    threads: int | None = field(
        default=None,
        metadata={
            "help": "torch threads for the engine's math (default: torch's choice, one per "
            "core, less one with an --executor on this host, which spins on a core while it "
            "waits for calls); 1 is steadiest when other processes share the cores "
            "(docs/serving.md)"
        },
    )
    prepack: bool = field(
        default=True,
        metadata={
            "flag": "--no-prepack",
            "help": "keep the base weights in the checkpoint's layout and every product "
            "torch's; by default, in fp32 on a CPU, linear layers of 512K weights or more "
            "are repacked once for oneDNN (1.2-2x faster matmuls), and smaller layers' "
            "products of a few rows run through symbiont's CPU kernel (results within fp32 "
            "rounding; docs/serving.md Threads). Never with --jobs-dir or --executor",
        },
    )
    api_process: bool = field(
        default=True,
        metadata={
            "flag": "--no-api-process",
            "help": "answer HTTP in this process, beside the engine, instead of in a second "
            "process (the default) that streams the engine's outputs to clients: one process "
            "and no hop between two, but the HTTP work then takes the engine thread's GIL "
            "(docs/serving.md, Threads)",
        },
    )
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        from symbiont.util.device import check_device

        check_device(self.device)
        for token, url, flags in (
            (self.executor_token, self.executor, ("--executor-token", "--executor")),
            (self.second_executor_token, self.second_executor, ("--second-executor-token", "--second-executor")),
        ):  # fmt: skip
            if token and not url:
                raise ValueError(f"{flags[0]} is the token of {flags[1]} URL; give that too")
        names = [entry[0] for entry in self.adapters + self.deltas]
        if len(set(names)) != len(names):
            raise ValueError(f"adapter and delta names must be unique, got {names}")
        if self.model_name in names:
            raise ValueError(
                f"an adapter may not be named like the base model ({self.model_name!r})"
            )
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if self.max_request_bytes < 1:
            raise ValueError(
                f"max_request_bytes must be >= 1, got {self.max_request_bytes}; the default "
                "is 8388608 (8 MiB)"
            )
        if self.adapter_dir is not None and not Path(self.adapter_dir).is_dir():
            raise ValueError(
                f"--adapter-dir {self.adapter_dir!r} is not a folder; create it or pass the "
                "folder that holds the adapters clients may load"
            )
        if self.tenants is not None:
            from symbiont.jobs.tenants import load_tenants

            load_tenants(self.tenants)  # a ValueError names the tenant and field to fix
        if self.api_key and self.tenants:
            raise ValueError("--tenants gives each tenant its key; leave out --api-key")
        if self.engine.slo_tpot_s is not None and self.jobs_dir is None:
            raise ValueError("--slo-tpot-ms paces fine-tuning jobs: pass --jobs-dir DIR too")
        authenticated = self.api_key or self.tenants
        if not authenticated and not self.allow_unauthenticated and not _loopback(self.host):
            raise ValueError(
                f"host {self.host!r} is reachable from other hosts: pass --api-key KEY so "
                "that only clients presenting it are served, or --allow-unauthenticated to "
                "serve anyone who reaches it"
            )

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name


def _loopback(host: str) -> bool:
    """Whether only this machine reaches `host` ("0.0.0.0" and host names do not count)."""
    bracketed = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return is_loopback(f"tcp://{bracketed}:0")
