"""What a tenant process opens, one way for `finetune`, `generate`, `serve` and `demo`: the
executor its base layers run on (in this process, or a `serve-base` reached by URL), the
client model over it, and the checkpoint's tokenizer.

Choosing in-process or remote is a placement decision of the process, so it lives here,
above both `symbiont.base` and `symbiont.client` (which never import each other).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from symbiont.protocol.executor import Executor

log = logging.getLogger(__name__)


def open_executor(
    model_dir,
    url: str | Sequence[str] | None = None,
    *,
    device="cpu",
    dtype=None,
    mask_activations: str | bool | None = None,
    prepack: bool = False,
    tokens: Sequence[str] | None = None,
    matmul: str = "torch",
) -> Executor:
    """The executor for `model_dir`: the `serve-base` at `url` (its base checked against
    `model_dir` at connect time), or an in-process BaseExecutor when `url` is None; with
    `prepack`, an in-process one on a CPU in fp32 holds its large weights in the matmul
    library's layout (faster, forward calls only: symbiont/base/prepack.py) and computes
    products of a few rows through symbiont's CPU kernel (symbiont/kernels/few_rows.py).

    mask_activations 'pool' wraps it so every call is masked; 'shares' takes two URLs
    (`serve-base`s of parties that do not collude) and splits every call between them
    (docs/privacy.md). `tokens`: each URL's serve-base --token, in order (default:
    $SYMBIONT_TOKEN for every one). `matmul` 'onednn': an in-process executor computes its
    products on oneDNN (symbiont/base/onednn.py); a serve-base's are set where it runs."""
    from symbiont.client.masking import MaskMode, mask_config, mask_executors

    urls = (url,) if url is None or isinstance(url, str) else tuple(url)
    config = mask_config(mask_activations)  # refuses an unknown mode before connecting
    if len(urls) > 1 and (config is None or config.mode is not MaskMode.SHARES):
        raise ValueError(
            f"{len(urls)} executor URLs given; several executors are only used by "
            "--mask-activations shares (two serve-base run by parties that do not collude)"
        )
    if config is not None and config.mode is MaskMode.SHARES and len(urls) != 2:
        raise ValueError(
            "--mask-activations shares needs two executors run by parties that do not "
            f"collude, got {'none' if urls == (None,) else len(urls)}: pass "
            "--executor URL_A --executor URL_B (symbiont serve: --executor URL_A "
            "--second-executor URL_B)"
        )
    if tokens and (urls == (None,) or len(tokens) != len(urls)):
        raise ValueError(
            f"{len(tokens)} --executor-token given for "
            f"{'no' if urls == (None,) else len(urls)} --executor; give one per --executor, "
            "in the same order"
        )
    tokens = tuple(tokens) if tokens else (None,) * len(urls)
    if matmul not in ("torch", "onednn"):
        raise ValueError(f"--matmul {matmul!r}: use torch or onednn")
    if matmul != "torch" and urls != (None,):
        raise ValueError(
            f"--matmul {matmul} sets how an executor in this process computes; a serve-base "
            f"computes as it was started: symbiont serve-base --matmul {matmul}"
        )
    spin = _spinning_pays(urls)
    executors = []
    try:
        for one, token in zip(urls, tokens, strict=True):
            executors.append(
                _open_one(
                    model_dir, one, device=device, dtype=dtype, prepack=prepack, token=token,
                    matmul=matmul, spin=spin,
                )
            )  # fmt: skip
    except BaseException:
        for executor in executors:
            executor.close()
        raise
    try:
        return mask_executors(model_dir, tuple(executors), config, device=device)
    except BaseException:
        for executor in executors:
            executor.close()
        raise


def _spinning_pays(urls: Sequence[str | None]) -> bool:
    """Whether this client and the serve-bases it reaches on this host may spin between
    calls: while each of them can have a core. Two serve-bases on this host (the two
    parties of --mask-activations shares, in a test or a demo) and a client on two cores
    would otherwise take turns at a core, every call: 19 against 88 tokens/s generated
    without spinning (docs/privacy.md)."""
    from symbiont.protocol.urls import is_loopback

    local = sum(1 for url in urls if url and is_loopback(url))
    return local < 2 or local + 1 <= _cores()


def _open_one(
    model_dir,
    url: str | None,
    *,
    device,
    dtype,
    prepack=False,
    token=None,
    matmul="torch",
    spin=True,
) -> Executor:
    if url is None:
        from symbiont.base.executor import BaseExecutor
        from symbiont.base.prepack import PrepackedExecutor, can_prepack

        executor = BaseExecutor.from_pretrained(model_dir, device=device, dtype=dtype)
        if matmul == "onednn":
            from symbiont.base.onednn import OneDnnExecutor

            executor = OneDnnExecutor(executor)  # refuses what oneDNN does not compute first
            executor.few_rows = _few_rows()
            return executor
        if prepack and can_prepack(executor.device, executor.manifest.dtype):
            return PrepackedExecutor(executor, few_rows=_few_rows())
        return executor
    from symbiont.client.remote import connect

    options = {} if token is None else {"token": token}  # else $SYMBIONT_TOKEN
    if not spin:  # neither side spins: each waits on a pipe (symbiont/protocol/shm.py)
        options.update(spin_us=0.0, executor_spin=False)
    # a client on the executor's GPU keeps calls' tensors there (CUDA IPC)
    return connect(url, checkpoint=model_dir, device=str(device), **options)


def _few_rows():
    """symbiont's few-rows product kernel, or None (and why, in the log)."""
    from symbiont.kernels import library
    from symbiont.kernels.few_rows import FewRows

    kernel = FewRows.load()
    if kernel is None:
        log.info(
            "base products of a few rows: torch's, as symbiont's CPU kernels could not be "
            "built (%s)",
            library.unavailable_reason(),
        )
    return kernel


def open_client(model_dir, executor: Executor, *, device="cpu", dtype=None, need_tokenizer=True):
    """The client model (frozen linear layers on `executor`) with its tokenizer (None when
    the checkpoint has none and `need_tokenizer` is False)."""
    from symbiont.client.loader import load_client

    model = load_client(model_dir, executor, device=device, dtype=dtype)
    return model, load_tokenizer(model_dir, required=need_tokenizer)


def load_tokenizer(model_dir: str | os.PathLike, *, required: bool = True):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as err:
        if not required:
            log.warning(
                "no tokenizer in %s (%s); only token-id prompts are accepted", model_dir, err
            )
            return None
        raise ValueError(
            f"no tokenizer in {model_dir} ({err}); symbiont needs the checkpoint folder "
            "to include its tokenizer files"
        ) from err


def set_threads(threads: int | None, executors: str | Sequence[str] | None = None) -> None:
    """Limit intra-op threads to `threads` (--threads). Without it, a client of a serve-base
    on this host (`executors`: the URLs it reaches) leaves that serve-base a core: the
    serve-base spins on one while it waits for the next call, and a client computing on
    every core then waits for a core at each parallel operation. On two cores, decoding
    through a serve-base ran 15-22x slower that way (docs/service.md)."""
    if threads is not None and threads < 1:  # 0 was silently ignored, -2 a torch error
        raise ValueError(f"--threads must be >= 1, got {threads}")
    import torch

    if threads:
        torch.set_num_threads(threads)
        return
    from symbiont.protocol.urls import is_loopback

    urls = (executors,) if isinstance(executors, str) else tuple(executors or ())
    if not any(url and is_loopback(url) for url in urls):
        return
    spare = max(1, _cores() - 1)
    if torch.get_num_threads() > spare:
        torch.set_num_threads(spare)
        log.info(
            "computing on %d thread(s), leaving a core to the serve-base on this host "
            "(--threads chooses)",
            spare,
        )


def _cores() -> int:
    """Cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
