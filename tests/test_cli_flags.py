"""The `symbiont` command line: --help without torch, every default from its config
dataclass, every documented flag real, and refusals that name the flag to fix."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from symbiont.base.config import BatchingPolicy, ServiceConfig
from symbiont.cli import SUBCOMMANDS, build_parser, main
from symbiont.cli.flags import config_actions, field_default
from symbiont.processes import reap, spawn
from symbiont.serve.config import EngineConfig
from symbiont.train.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "peft", "fastapi")


def subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser(command)
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


@pytest.mark.parametrize("command", ["", *SUBCOMMANDS])
def test_help_imports_no_torch(command):
    code = (
        "import sys\n"
        "from symbiont.cli import main\n"
        f"try:\n    main([*{command!r}.split(), '--help'])\n"
        "except SystemExit as done:\n    assert done.code == 0, done.code\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert not heavy, f'--help imported {heavy}'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, f"symbiont {command} --help:\n{result.stderr[-2000:]}"
    assert "usage: symbiont" in result.stdout


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_no_flag_repeats_a_dataclass_default(command):
    parser = subparser(command)
    generated = config_actions(parser)
    for action in parser._actions:
        if action in generated:
            cls, name = action.config_field
            want = getattr(action, "config_default", field_default(cls, name))
            if action.required:
                want = None  # no default: the flag must be given
            got = action.default
            if action.nargs is None and action.option_strings and isinstance(want, tuple):
                want = None  # repeatable flags: the dataclass fills in the default
            assert got == want or (got is None and want == ()), (
                f"{command} {action.option_strings}: default {got!r}, {cls.__name__}.{name} "
                f"says {want!r}"
            )
        elif action.option_strings and not isinstance(action, argparse._HelpAction):
            assert action.default in (None, False), (
                f"{command} {action.option_strings} has its own default {action.default!r}: "
                "declare it on a config dataclass field and generate the flag"
            )
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            assert action.help, f"{command} {action.option_strings} has no help text"


@pytest.mark.parametrize(
    "command, argv, classes",
    [
        ("serve-base", ["--model", "m"], [ServiceConfig, BatchingPolicy]),
        ("serve", ["--model", "m"], [EngineConfig]),
        ("finetune", ["--model", "m", "--data", "d", "--out", "o"], [TrainConfig]),
    ],
)
def test_parsed_defaults_build_the_default_configs(command, argv, classes):
    from symbiont.cli.flags import from_args

    args = build_parser(command).parse_args([command, *argv])
    for cls in classes:
        assert from_args(cls, args) == from_args(cls, argparse.Namespace()) == cls(), cls


def test_serve_base_flags_in_their_units():
    from symbiont.cli.serve_base import configs

    argv = ["serve-base", "--model", "m", "--max-wait-ms", "7", "--wait-per-token-us", "300"]
    argv += ["--max-call-mb", "2", "--no-shm", "--policy", "lockstep", "--bind", "ipc:///tmp/x"]
    process, service = configs(build_parser("serve-base").parse_args(argv))
    assert service.policy.max_wait_s == pytest.approx(0.007)
    assert service.policy.wait_per_token_s == pytest.approx(300e-6)
    assert service.policy.kind == "lockstep"
    assert service.max_call_bytes == 2 * 2**20 and service.allow_shm is False
    assert service.bind == ("ipc:///tmp/x",), "a given --bind replaces the default"
    assert process.model == "m" and process.device == "cpu"


@pytest.mark.parametrize("name", ["--max-loras", "--max-adapters"])
def test_a_renamed_flag_keeps_its_earlier_name(name):
    args = build_parser("serve").parse_args(["serve", "--model", "m", name, "7"])
    assert args.max_adapters == 7


def test_bad_core_list_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as done:
        main(["serve-base", "--model", "m", "--cpus", "0-100000"])
    assert done.value.code == 2
    assert "pick among those" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, names",
    [
        (["serve-base", "--model", "m", "--bind", "tcp://0.0.0.0:7100"], ["--token"]),
        (["serve", "--model", "m", "--host", "0.0.0.0"], ["--api-key"]),
    ],
)
def test_exposed_without_a_key_refuses_naming_the_flags(argv, names, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2, err
    for name in [*names, "--allow-unauthenticated"]:
        assert name in err, f"the refusal should name {name}:\n{err}"
    assert f"usage: symbiont {argv[0]}" in err


def test_exposed_on_purpose_is_allowed():
    from symbiont.cli.serve import configs as serve_configs
    from symbiont.cli.serve_base import configs as base_configs

    argv = ["serve", "--model", "m", "--host", "0.0.0.0", "--allow-unauthenticated"]
    assert serve_configs(build_parser("serve").parse_args(argv)).host == "0.0.0.0"
    argv = ["serve-base", "--model", "m", "--bind", "tcp://0.0.0.0:7100"]
    _, service = base_configs(build_parser("serve-base").parse_args([*argv, "--token", "t"]))
    assert service.token == "t"
    argv.append("--allow-unauthenticated")
    _, service = base_configs(build_parser("serve-base").parse_args(argv))
    assert service.token is None and service.allow_unauthenticated


def test_invalid_config_value_goes_through_argparse(capsys):
    with pytest.raises(SystemExit) as done:
        main(["finetune", "--model", "m", "--data", "d", "--out", "o", "--lr", "0"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "lr must be > 0" in err, err


def test_finetune_refuses_an_existing_run_without_resume_or_overwrite(tmp_path, capsys):
    out = tmp_path / "run"
    (out / "checkpoint-000002").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit) as done:
        main(["finetune", "--model", "m", "--data", "d", "--out", str(out)])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert "--resume" in err and "--overwrite" in err and "already holds a run" in err
    assert (out / "metrics.jsonl").exists(), "a refused run must not touch --out"
    with pytest.raises(SystemExit):
        main(["finetune", "--model", "m", "--data", "d", "--out", str(out), "--resume", "--overwrite"])  # fmt: skip


def test_overwrite_keeps_the_earlier_run_when_the_new_one_cannot_start(tmp_path, capsys):
    """--overwrite removed the earlier run before reading --data: a typo cost it."""
    out = tmp_path / "run"
    (out / "checkpoint-000002").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")
    (out / "adapter_model.safetensors").write_bytes(b"earlier")
    argv = ["finetune", "--model", "default", "--data", str(tmp_path / "missing.jsonl")]
    assert main([*argv, "--out", str(out), "--overwrite", "--no-progress"]) == 1
    assert "missing.jsonl: no such file" in capsys.readouterr().err
    assert (out / "adapter_model.safetensors").read_bytes() == b"earlier"
    assert (out / "checkpoint-000002").is_dir() and (out / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--method", "prefix", "--target", "q_proj", "--r", "64"], "--method prefix does not use --r, --target"),
        (["--method", "loha", "--dropout", "0.5"], "--method loha does not use --dropout; leave it out"),
        (["--method", "ia3", "--virtual-tokens", "4"], "--method ia3 does not use --virtual-tokens"),
        (["--eval-every", "2"], "--eval-every evaluates on --eval-data FILE"),
        (["--peft-config", "cfg.json", "--alpha", "3"], "--peft-config sets the whole adapter; leave out --alpha"),
    ],
)  # fmt: skip
def test_flags_the_adapter_would_drop_are_refused(tmp_path, capsys, flags, message):
    """They were accepted and silently did nothing."""
    argv = ["finetune", "--model", "default", "--data", "d.jsonl", "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as done:
        main([*argv, *flags])
    assert done.value.code == 2 and message in capsys.readouterr().err


# Flags named in the docs: on a shell line `symbiont CMD ... --flag`, CMD must have the
# flag; in prose, the page's command or one named earlier in the section must have it.
# Lines running other programs (pytest, benchmarks) are skipped.
DOC_COMMAND = {"finetune.md": "finetune", "serving.md": "serve", "service.md": "serve-base"}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
COMMAND = re.compile(r"symbiont (" + "|".join(map(re.escape, SUBCOMMANDS)) + r")(?![\w-])")
SHELL_LINE = re.compile(
    r"^\s*(?:\$ )?symbiont (" + "|".join(map(re.escape, SUBCOMMANDS)) + r")(?![\w-])"
)
OTHER_PROGRAM = re.compile(
    r"\b(pytest|pip|python3? (?!-m symbiont)\S+|benchmarks/|uvicorn|lm_eval)"
)


def documented_flags():
    """(where, commands that may own it, flag) for every flag the docs name."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for page in pages:
        text = re.sub(r"\\\n\s*", " ", page.read_text())  # join continued shell lines
        section: set[str] = set()
        for number, line in enumerate(text.splitlines(), 1):
            if line.startswith("#"):
                section = set()
            section.update(COMMAND.findall(line))
            if OTHER_PROGRAM.search(line):
                continue
            shell = SHELL_LINE.match(line)
            owners = {shell[1]} if shell else section | {DOC_COMMAND.get(page.name)} - {None}
            for flag in FLAG.findall(line):
                yield f"{page.name}:{number}", owners or set(SUBCOMMANDS), flag


def all_options(parser: argparse.ArgumentParser) -> set[str]:
    """The parser's flags and those of its own subcommands (`symbiont delta compress`)."""
    found = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found = found.union(*(all_options(sub) for sub in action.choices.values()))
    return found


def test_every_flag_the_docs_name_exists():
    options = {c: all_options(subparser(c)) for c in SUBCOMMANDS}
    missing = [
        f"{where}: no {flag} in symbiont {' or '.join(sorted(owners))}"
        for where, owners, flag in documented_flags()
        if flag not in {"--help", "--verbose"}.union(*(options[c] for c in owners))
    ]
    assert not missing, "\n".join(missing)


def test_child_memory_is_its_own_peak_pss_not_the_parents(tmp_path):
    """ru_maxrss of a child starts at its parent's peak; sampled PSS does not."""
    ballast = bytearray(300 * 2**20)  # the parent's peak grows by 300 MiB
    ballast[::4096] = b"x" * len(ballast[::4096])
    every = 0.1  # sampling is only on request
    small = spawn(
        "small", [], tmp_path, python=["-c", "import time; time.sleep(1.5)"], pss_interval_s=every
    )
    big = spawn(
        "big",
        [],
        tmp_path,
        python=[
            "-c",
            "import time; b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(1.5)",
        ],  # fmt: skip
        pss_interval_s=every,
    )
    unsampled = spawn("unsampled", [], tmp_path, python=["-c", "pass"])
    for job in (small, big, unsampled):
        assert reap(job).returncode == 0, job.log.read_text()
    assert small.peak_pss is not None and small.peak_pss < 100 * 2**20, small.peak_pss
    assert big.peak_pss is not None and big.peak_pss > 200 * 2**20, big.peak_pss
    assert unsampled.peak_pss is None and unsampled._sampler is None
    del ballast
