"""benchmarks/multi_finetune.py at its smallest: N fine-tuning jobs as vanilla processes
and through one serve-base, with memory (PSS) and CPU time per process in its report."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_benchmark_reports_throughput_memory_and_cpu(tmp_path):
    done = subprocess.run(
        [
            sys.executable, str(REPO / "benchmarks" / "multi_finetune.py"), "--model", "4m",
            "--jobs", "1", "--steps", "4", "--arms", "vanilla,symbiont", "--work", str(tmp_path),
        ],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=600, check=True,
    )  # fmt: skip
    out = done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    # N, two arms' tok/s and GiB, then the split's throughput and memory ratios
    row = re.search(r"^\s+1((?:\s+[\d.]+){4})\s+([\d.]+)x\s+([\d.]+)x$", out, re.M)
    assert row, out
    assert all(float(v) > 0 for v in row.group(1).split()), out
    assert "CPU ms per step of one job" in out, out
    cpu = re.search(
        r"^\s+1\s+([\d.]+)\s+([\d.]+)\s+(\d+)%\s+([\d.]+)\s+([\d.]+)\s+(\d+)%$", out, re.M
    )
    assert cpu, out
    vanilla_job, _, vanilla_cores, split_job, split_exec, split_cores = map(float, cpu.groups())
    assert vanilla_job > 0 and split_job > 0
    assert split_exec > 0  # the split's products run in serve-base, counted there
    assert 0 < vanilla_cores <= 100 and 0 < split_cores <= 100


def test_vanilla_jobs_may_take_the_cores_among_them(monkeypatch):
    """--vanilla-threads share: the vanilla (and private) jobs divide the cores among
    them, the split's clients keep --worker-threads; a bad value is refused by name."""
    import importlib.util
    from argparse import Namespace

    spec = importlib.util.spec_from_file_location(
        "multi_finetune", REPO / "benchmarks" / "multi_finetune.py"
    )
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "multi_finetune", bench)  # its dataclasses look it up
    spec.loader.exec_module(bench)
    cores = len(os.sched_getaffinity(0))
    args = Namespace(worker_threads=1, vanilla_threads="share")
    assert bench._job_threads("vanilla", 1, args) == cores
    assert bench._job_threads("private", 1, args) == cores
    assert bench._job_threads("vanilla", 2 * cores, args) == 1
    assert bench._job_threads("symbiont", 1, args) == 1
    args.vanilla_threads = "3"
    assert bench._job_threads("vanilla", 4, args) == 3
    args.vanilla_threads = None
    assert bench._job_threads("vanilla", 1, args) == 1
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "multi_finetune.py"), "--vanilla-threads", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--vanilla-threads: a number of threads (1 or more) or 'share', not '0'" in done.stderr
