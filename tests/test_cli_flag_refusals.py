"""Flags that parse but make no sense are refused by name before anything loads (each of
these once crashed a running serve-base, or ended in a traceback)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import symbiont
from symbiont.cli import main

DEFAULT = str(symbiont.default_model())
SFT = Path(symbiont.__file__).parent / "assets" / "sft.jsonl"


def refused(capsys, argv: list[str]) -> str:
    """What the command printed on stderr; it must end with a usage error (2) or an
    error (1), never with a traceback."""
    try:
        code = main(argv)
    except SystemExit as exit_info:  # argparse's error(): flags that make no config
        code = exit_info.code
    err = capsys.readouterr().err
    assert code in (1, 2) and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--max-wait-ms", "inf"),  # serve-base died of OverflowError once two clients met
        ("--max-wait-ms", "nan"),
        ("--max-wait-ms", "-5"),
        ("--wait-per-token-us", "inf"),
        ("--spin-us", "nan"),
        ("--spin-us", "-5"),
    ],
)
def test_serve_base_refuses_waits_that_are_not_finite(capsys, flag, value):
    err = refused(capsys, ["serve-base", "--model", DEFAULT, flag, value])
    assert f"{flag} must be a number in [0, " in err


@pytest.mark.parametrize("value", ["inf", "nan", "0"])
def test_stats_refuses_a_timeout_it_cannot_wait(capsys, value):
    err = refused(capsys, ["stats", "tcp://127.0.0.1:1", "--timeout", value])
    assert "--timeout must be in (0, 3600] seconds" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
@pytest.mark.parametrize("command", ["generate", "serve-base", "finetune"])
def test_a_cuda_device_without_cuda_is_refused_by_name(capsys, command, tmp_path):
    argv = [command, "--model", DEFAULT, "--device", "cuda"]
    more = {
        "generate": ["--prompt", "hi"],
        "finetune": ["--data", str(SFT), "--out", str(tmp_path / "run")],
    }
    err = refused(capsys, argv + more.get(command, []))
    assert not (tmp_path / "run").exists(), "nothing is written before the device is checked"
    assert "--device cuda: this torch build or machine has no CUDA GPU" in err


def test_a_device_that_is_no_device_is_refused(capsys):
    err = refused(capsys, ["generate", "--model", DEFAULT, "--prompt", "hi", "--device", "bogus"])
    assert "--device 'bogus' is not a device name" in err


@pytest.mark.parametrize("threads", ["0", "-2"])
def test_threads_below_one_are_refused(capsys, threads):
    err = refused(capsys, ["generate", "--model", DEFAULT, "--prompt", "hi", "--threads", threads])
    assert f"--threads must be >= 1, got {threads}" in err


def test_generate_into_a_reader_that_leaves_early_prints_no_error(tmp_path):
    """`symbiont generate ... | head -c 3` printed 'error: [Errno 32] Broken pipe'."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "symbiont", "generate", "--model", DEFAULT, "--prompt", "The"]
    argv += ["--max-new-tokens", "200", "--stream", "--threads", "1"]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.read(3)
    child.stdout.close()  # the reader leaves
    _, err = child.communicate(timeout=120)
    assert "Broken pipe" not in err.decode() and "Traceback" not in err.decode(), err.decode()


def test_a_ready_file_in_a_missing_folder_is_refused_before_listening(capsys, tmp_path):
    """It failed after binding and logging 'serving', naming a temporary file."""
    ready = tmp_path / "missing" / "ready.json"
    err = refused(capsys, ["serve-base", "--model", DEFAULT, "--ready-file", str(ready)])
    assert f"--ready-file {ready}: its folder does not exist" in err and "serving" not in err


def test_finetune_out_that_is_a_file_is_refused_before_loading(capsys, tmp_path):
    (tmp_path / "afile").write_text("x")
    argv = ["finetune", "--model", DEFAULT, "--data", str(SFT), "--out", str(tmp_path / "afile")]
    err = refused(capsys, argv)
    assert "--out" in err and "is a file" in err
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize(
    "url, message",
    [
        ("tcp://127.0.0.1", "has no port: write tcp://HOST:PORT"),
        ("ipc://", "has no path"),
        ("tcp://127.0.0.1:99999", "the port must be 1-65535"),  # ZeroMQ wrapped it
    ],
)
def test_an_executor_url_without_port_or_path_is_refused_by_name(capsys, url, message):
    """serve-base --bind tcp://127.0.0.1 said only ZeroMQ's 'Invalid argument'."""
    err = refused(capsys, ["serve-base", "--model", DEFAULT, "--bind", url])
    assert message in err
