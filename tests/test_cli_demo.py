"""The README's main command, `symbiont demo`, end to end on a small budget."""

from __future__ import annotations

import os
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
    for method in ("lora", "ia3", "prefix"):  # each tenant left a standard PEFT adapter
        adapter = tmp_path / "demo" / method
        assert (adapter / "adapter_config.json").is_file(), f"no adapter written for {method}"
        assert (adapter / "adapter_model.safetensors").is_file()
