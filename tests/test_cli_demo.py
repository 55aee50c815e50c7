"""The README's main command, `symbiont demo`, end to end on a small budget."""

from __future__ import annotations

import os
import re
import subprocess
import sys


def test_demo_runs_every_tenant_and_prints_the_table(model_dir, tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "symbiont",
            "demo",
            "--model",
            str(model_dir),
            "--steps",
            "2",
            "--max-new-tokens",
            "4",
            "--out",
            str(tmp_path / "demo"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = result.stdout
    for row in (
        "lora      LORA",
        "ia3       IA3",
        "prefix    PREFIX_TUNING",
        "generate  none (base)",
    ):
        assert row in table, f"demo table lacks {row!r}:\n{table}"
    assert "executor (serve-base)" in table and "separate full-model jobs" in table
    assert "executor  serve-base" in table, f"no executor row in the table:\n{table}"

    # The generating client continues a passage of the training corpus, next to the corpus.
    assert "prompt  'The central processing unit, usually called the CPU,'" in table
    assert "  corpus  'is" in table  # as many corpus words as were generated
    assert re.search(r"the first \d+ of \d+ generated words are the corpus's own", table)

    # Both setups' memory is measured (peak PSS of every process), and the verdict is one
    # line that follows from the two measured totals.
    shared = re.search(r"shared: +4 clients \+ executor (\d+) MiB", table)
    separate = re.search(r"separate full-model jobs \(measured[^)]*\) (\d+) MiB", table)
    assert shared and separate, f"memory of both setups not reported:\n{table}"
    shared_mib, separate_mib = int(shared[1]), int(separate[1])
    assert 100 < shared_mib < 20000 and 100 < separate_mib < 20000, (shared_mib, separate_mib)
    verdict = table.strip().splitlines()[-1]
    word = "saved" if separate_mib > shared_mib else "cost"
    assert verdict.startswith(f"sharing {word} "), f"verdict contradicts the totals: {verdict}"
    alone = re.findall(r"^(lora|ia3|prefix|generate) .* (\d+) MiB +(\d+) MiB$", table, re.M)
    assert len(alone) == 4, f"each client needs its PSS shared and alone:\n{table}"
    # and its throughput both ways (only the shared run's was shown)
    rates = re.findall(r"^(?:lora|ia3|prefix|generate) .* ([\d.]+) +([\d.]+) +\d+ MiB", table, re.M)
    assert len(rates) == 4 and all(float(a) > 0 and float(b) > 0 for a, b in rates), table
    for method in ("lora", "ia3", "prefix"):  # each tenant left a standard PEFT adapter
        adapter = tmp_path / "demo" / method
        assert (adapter / "adapter_config.json").is_file(), f"no adapter written for {method}"
        assert (adapter / "adapter_model.safetensors").is_file()
        alone = tmp_path / "demo" / "separate" / method  # and again as a separate job
        assert (alone / "adapter_model.safetensors").is_file(), f"no separate run of {method}"
