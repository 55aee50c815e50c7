"""Decode and prefill-chunk attention of our own on a CPU, built once with the machine's
C++ compiler.

PyTorch's CPU `scaled_dot_product_attention` runs a decode step (one query per sequence)
through its flash kernel, which handles each (sequence, head) as a tiny matrix product
and reads K/V at about half the bandwidth a plain stream gets (BENCHMARKS.md, issue 17,
session 13). `csrc/decode_attention.cpp` does the same math as one loop per (sequence,
KV head): it reads each K and V row once for all the query heads that share it, and keeps
its accumulators in registers. One layer's decode attention ran 1.8-2.8x faster than
SDPA on one core and 1.8-3.3x on two (`python benchmarks/decode_attention.py --layers 8`).

The kernel has no PyTorch headers: it is compiled in about a second with `-O3
-march=native`, with the lean forward's norm and rotary kernels (`csrc/layer_ops.cpp`,
layer_ops.py), into one shared library under `$SYMBIONT_HOME/kernels` (default
`~/.cache/symbiont/kernels`), named by a hash of the sources, the compiler, its flags and
this CPU, and called through `ctypes` (which releases the GIL). It runs on the threads
of torch's own OpenMP runtime (the process has one `libgomp.so.1`, torch's), as many as
`torch.get_num_threads()`.

A prefill chunk (`DecodeKernel.chunk`, `csrc/chunk_attention.cpp`) attends through the
same library: tiles of 32 queries (16 without AVX-512) of one head work through their keys
64 at a time with scores and output held keys- and dims-by-queries, so the online softmax
is element-wise across vectors; causal and window limits are computed, not read from a
mask. A chunk's attention ran 2.0-2.5x faster than SDPA's (in blocks of
queries) on one core (BENCHMARKS.md, issue 17, session 17).

Where it cannot be built (no compiler, a compiler too old for `__builtin_shufflevector`:
GCC 12 or clang), `load()` returns None and says why in `unavailable_reason()`; the engine
then uses SDPA, as it does for anything the kernel does not cover (not float32, not on a
CPU, soft-capped logits). `symbiont serve --no-decode-kernel` always uses SDPA. Results
agree with SDPA within float32 rounding, not bit for bit (another summation order, and a
polynomial exp good to about 1 ulp).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
# one library: decode and prefill-chunk attention, and the lean forward's norms and rotary
# (layer_ops.py)
SOURCES = (CSRC / "decode_attention.cpp", CSRC / "chunk_attention.cpp", CSRC / "layer_ops.cpp")
HEADERS = (CSRC / "vec.h",)
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")
COMPILE_TIMEOUT_S = 120

_lock = threading.Lock()
_why_not: list[str] = []  # the reason the last load() gave None


class DecodeKernel:
    """`kernel(q, k, v, mask, scale)`: softmax(q kᵀ · scale + mask) v for one query per
    sequence, where `applies` says the tensors fit it."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        self.lib = lib  # also holds the kernels of layer_ops.py
        self._fn = lib.decode_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._fn.argtypes = [ptr, i64, i64, i64] * 3 + [ptr, i64, ptr] + [i64] * 5
        self._fn.argtypes += [ctypes.c_float, ptr, ctypes.c_int]
        self._fn.restype = None
        self._chunk = lib.chunk_attention
        self._chunk.argtypes = [ptr, i64, i64] * 4 + [i64] * 6 + [ctypes.c_float, ptr, ctypes.c_int]
        self._chunk.restype = ctypes.c_int
        self._chunk_scratch = lib.chunk_attention_scratch
        self._chunk_scratch.argtypes = [i64]
        self._chunk_scratch.restype = i64

    @staticmethod
    def applies(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> bool:
        """Whether the kernel computes this call: float32 on a CPU, head dims contiguous,
        no gradient wanted (the kernel has no backward)."""
        return (
            q.device.type == "cpu"
            and q.dtype == k.dtype == mask.dtype == torch.float32
            and q.stride(-1) == 1
            and k.stride(-1) == 1
            and not (q.requires_grad or k.requires_grad)
        )

    def __call__(
        self,
        q: torch.Tensor,  # [n, kv_heads, share, hd]: query heads grouped by their KV head
        k: torch.Tensor,  # [n, kv_heads, L, hd], any strides but the last
        v: torch.Tensor,  # [n, kv_heads, L, hd], any strides but the last
        mask: torch.Tensor,  # [n, 1, 1, L] additive: 0 or -inf
        scale: float,
    ) -> torch.Tensor:  # [n, kv_heads, share, hd]
        n, kv_heads, share, hd = q.shape
        width = k.shape[2]
        if k.shape != (n, kv_heads, width, hd) or v.shape != k.shape:
            raise ValueError(
                f"decode kernel: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        if v.stride(-1) != 1:
            v = v.contiguous()
        rows = mask.reshape(n, width)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        threads = max(1, torch.get_num_threads())
        out = q.new_empty(n, kv_heads, share, hd)
        scratch = q.new_empty(threads * share * ((width + 15) // 16 * 16))  # rows of whole vectors
        self._fn(
            q.data_ptr(), *q.stride()[:3],
            k.data_ptr(), *k.stride()[:3],
            v.data_ptr(), *v.stride()[:3],
            rows.data_ptr(), rows.stride(0),
            out.data_ptr(), n, kv_heads, share, width, hd,
            scale, scratch.data_ptr(), threads,
        )  # fmt: skip
        return out

    @staticmethod
    def chunk_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether `chunk` computes this call: float32 on a CPU, head dims contiguous and
        a multiple of 8, no gradient wanted (the kernel has no backward)."""
        return (
            q.device.type == "cpu"
            and q.dtype == k.dtype == v.dtype == torch.float32
            and q.shape[-1] % 8 == 0
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
            and not (q.requires_grad or k.requires_grad or v.requires_grad)
        )

    def chunk(
        self,
        q: torch.Tensor,  # [heads, m, hd]: one prefill chunk's queries
        k: torch.Tensor,  # [kv_heads, >= start + m, hd]: its context, then its own keys
        v: torch.Tensor,  # [kv_heads, >= start + m, hd]
        start: int,  # position of the chunk's first query
        window: int | None,  # sliding window: a query sees keys after its position - window
        scale: float,
    ) -> torch.Tensor:  # [m, heads, hd]
        """Causal attention of one chunk: query i (position start + i) attends keys
        j <= start + i (and j > start + i - window)."""
        heads, m, hd = q.shape
        kv_heads = k.shape[0]
        if window is not None and window < 1:  # the engine's mask would hide every key
            raise ValueError(f"chunk kernel: sliding window {window}; it must be at least 1")
        if (
            k.shape[1] < start + m
            or v.shape[:2] != k.shape[:2]
            or k.shape[2] != hd
            or v.shape[2] != hd
            or heads % kv_heads
        ):
            raise ValueError(
                f"chunk kernel: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                f"start {start}"
            )
        threads = max(1, torch.get_num_threads())
        out = q.new_empty(m, heads, hd)
        scratch = q.new_empty(threads * self._chunk_scratch(hd))
        failed = self._chunk(
            q.data_ptr(), *q.stride()[:2],
            k.data_ptr(), *k.stride()[:2],
            v.data_ptr(), *v.stride()[:2],
            out.data_ptr(), *out.stride()[:2],
            heads, kv_heads, m, hd, start, window or 0,
            scale, scratch.data_ptr(), threads,
        )  # fmt: skip
        if failed:
            raise ValueError(f"chunk kernel: head_dim {hd} is no multiple of 8")
        return out


def load() -> DecodeKernel | None:
    """The kernel, built on the first call of this process (cached on disk), or None
    where it cannot be built: `unavailable_reason()` then says why."""
    with _lock:
        return _load()


def unavailable_reason() -> str | None:
    """Why `load()` returned None (None when it returned the kernel or was not called)."""
    return _why_not[-1] if _why_not else None


@functools.cache
def _load() -> DecodeKernel | None:
    try:
        kernel = _built_kernel()
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as err:
        _why_not.append(str(err))
        return None
    _why_not.clear()
    return kernel


def _built_kernel() -> DecodeKernel:
    """The compiled kernel for this source, compiler and CPU; compiled if not cached."""
    compiler = _compiler()
    flags = FLAGS + _openmp_flags()
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    key = hashlib.sha256()
    for part in (
        *(source.read_bytes() for source in SOURCES + HEADERS),
        compiler.encode(),
        version.encode(),
        " ".join(flags).encode(),
    ):
        key.update(part)
    key.update(_cpu_fingerprint().encode())
    name = f"cpu_kernels-{key.hexdigest()[:16]}.so"
    tried = []
    for folder in _folders():
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            dir_fd = _open_own_folder(folder)
        except OSError as err:
            tried.append(f"{folder}: {err.strerror or err}")
            continue
        try:
            return _load_or_build(folder, dir_fd, name, compiler, flags)
        finally:
            os.close(dir_fd)
    raise RuntimeError(f"no folder of this user's own for the CPU kernels ({'; '.join(tried)})")


def _folders() -> list[Path]:
    """Where the library may live: the cache folder, else a private temporary one."""
    tmp = Path(tempfile.gettempdir()) / f"symbiont-kernels-{os.getuid()}"
    home = os.environ.get("SYMBIONT_HOME")
    try:
        root = Path(home).expanduser() if home else Path.home() / ".cache" / "symbiont"
    except (RuntimeError, KeyError):  # no $HOME and a uid without a passwd entry
        return [tmp]
    return [root / "kernels", tmp]


# A folder is checked, then used through its file descriptor, and the library is opened
# relative to it and checked again: whoever can write the folder's parent could swap
# the folder between a check by path and a load by path.
_OPEN_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
_OPEN_FILE = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _open_own_folder(folder: Path) -> int:
    fd = os.open(folder, _OPEN_DIR)
    why_not = _unsafe(os.fstat(fd))
    if why_not:  # another user could have put a library of theirs here
        os.close(fd)
        raise OSError(why_not)
    return fd


def _unsafe(info: os.stat_result) -> str | None:
    """Why a file or folder could be someone else's (None: it is ours alone)."""
    if info.st_uid != os.getuid():
        return f"owned by uid {info.st_uid}, not this user ({os.getuid()})"
    if info.st_mode & 0o022:
        return f"writable by others (mode {info.st_mode & 0o777:o}); chmod go-w it"
    return None


def _load_or_build(
    folder: Path, dir_fd: int, name: str, compiler: str, flags: tuple[str, ...]
) -> DecodeKernel:
    try:
        return _open_library(folder, dir_fd, name)
    except FileNotFoundError:
        pass
    except (OSError, AttributeError) as err:  # truncated, foreign, not ours: built anew
        log.info("rebuilding the CPU kernels: %s", err)
    _compile(compiler, flags, folder, dir_fd, name)
    return _open_library(folder, dir_fd, name)


def _open_library(folder: Path, dir_fd: int, name: str) -> DecodeKernel:
    fd = os.open(name, _OPEN_FILE, dir_fd=dir_fd)
    try:
        why_not = _unsafe(os.fstat(fd))
        if why_not:
            raise OSError(f"{folder / name}: {why_not}")
        # the very file checked, whatever its folder's path now leads to
        proc = f"/proc/self/fd/{fd}"
        lib = ctypes.CDLL(proc if os.path.exists(proc) else str(folder / name))
    finally:
        os.close(fd)
    return DecodeKernel(lib, folder / name)


def _compile(compiler: str, flags: tuple[str, ...], folder: Path, dir_fd: int, name: str) -> None:
    # Another process may build the same file: each writes its own, then renames it over.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *flags, *map(str, SOURCES), "-o", partial],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            names = ", ".join(source.name for source in SOURCES)
            raise RuntimeError(f"{compiler} could not build {names}: {last}")
        # inside the folder checked: a partial file not found there was written elsewhere
        os.chmod(Path(partial).name, 0o700, dir_fd=dir_fd)  # whatever the umask
        os.replace(Path(partial).name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        log.info("CPU kernels built: %s", folder / name)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise RuntimeError("no C++ compiler found (set $CXX, or install g++ >= 12 or clang)")


def _openmp_flags() -> tuple[str, ...]:
    """-fopenmp where torch ships libgomp: the kernel's DT_NEEDED libgomp.so.1 then binds
    to the copy torch already loaded, so both share one thread pool. Elsewhere a second
    OpenMP runtime would spin beside torch's, so the kernel stays on one thread."""
    return ("-fopenmp",) if (Path(torch.__file__).parent / "lib" / "libgomp.so.1").exists() else ()


def _cpu_fingerprint() -> str:
    """What -march=native depends on: a cached build must not run on another CPU."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))
