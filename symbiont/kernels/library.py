"""symbiont's CPU kernels: one shared library, built once with the machine's C++ compiler.

The kernels (`csrc/`) have no PyTorch headers: they are compiled in about a second with
`-O3 -march=native` into one shared library under `$SYMBIONT_HOME/kernels` (default
`~/.cache/symbiont/kernels`), named by a hash of the sources, the compiler, its flags and
this CPU, and called through `ctypes` (which releases the GIL). They run on the threads of
torch's own OpenMP runtime (the process has one `libgomp.so.1`, torch's), as many as
`torch.get_num_threads()`. Only a folder of this user's own, writable by no one else, is
used, and the library is opened through the descriptor of the file checked.

What the library holds, and who calls it:

- `decode_attention.cpp`, `chunk_attention.cpp`: the serving engine's attention
  (symbiont/serve/decode_kernel.py);
- `layer_ops.cpp`: the lean forward's norms and rotary embedding (symbiont/serve/layer_ops.py);
- `few_rows.cpp`: base products of a few rows (`few_rows.py` here), for the serving
  executor and `serve-base --matmul onednn` (symbiont/base/);
- `lora_rows.cpp`: the serving engine's LoRA of tokens each on its own adapter
  (`lora_rows.py` here, used by symbiont/serve/adapters.py).

Where it cannot be built (no compiler, a compiler too old for `__builtin_shufflevector`:
GCC 12 or clang), `load()` returns None and `unavailable_reason()` says why; every caller
then uses PyTorch's operations.
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
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
# one library: decode and prefill-chunk attention (serve/decode_kernel.py), the lean
# forward's norms and rotary (serve/layer_ops.py), products of a few rows (few_rows.py) and
# LoRA rows read in place (lora_rows.py)
SOURCES = (
    CSRC / "decode_attention.cpp",
    CSRC / "chunk_attention.cpp",
    CSRC / "layer_ops.cpp",
    CSRC / "few_rows.cpp",
    CSRC / "lora_rows.cpp",
)
HEADERS = (CSRC / "vec.h",)
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")
COMPILE_TIMEOUT_S = 120

_lock = threading.Lock()
_why_not: list[str] = []  # the reason the last load() gave None


@dataclass(frozen=True, eq=False)
class Library:
    """The loaded library (its functions on `cdll`) and the file it was loaded from."""

    cdll: ctypes.CDLL
    path: Path


def load() -> Library | None:
    """The library, built on the first call of this process (cached on disk), or None
    where it cannot be built: `unavailable_reason()` then says why."""
    with _lock:
        return _load()


def unavailable_reason() -> str | None:
    """Why `load()` returned None (None when it returned the kernel or was not called)."""
    return _why_not[-1] if _why_not else None


@functools.cache
def _load() -> Library | None:
    try:
        kernel = _built_kernel()
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as err:
        _why_not.append(str(err))
        return None
    _why_not.clear()
    return kernel


def _built_kernel() -> Library:
    """The compiled library for this source, compiler and CPU; compiled if not cached."""
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
) -> Library:
    try:
        return _open_library(folder, dir_fd, name)
    except FileNotFoundError:
        pass
    except (OSError, AttributeError) as err:  # truncated, foreign, not ours: built anew
        log.info("rebuilding the CPU kernels: %s", err)
    _compile(compiler, flags, folder, dir_fd, name)
    return _open_library(folder, dir_fd, name)


def _open_library(folder: Path, dir_fd: int, name: str) -> Library:
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
    _check_symbols(lib)
    return Library(lib, folder / name)


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


SYMBOLS = ("decode_attention", "chunk_attention", "chunk_attention_scratch", "rms_norm", "rotary")
SYMBOLS += ("few_rows_linear", "lora_rows", "lora_rows_bf16")


def _check_symbols(lib: ctypes.CDLL) -> None:
    """AttributeError (the file is rebuilt) where a function of the sources is missing."""
    for name in SYMBOLS:
        getattr(lib, name)
