"""Loading a base for `serve-base` without importing transformers' models into its process.

Which checkpoint key feeds which layer is decided by transformers (the model class for the
config, its key conversion mapping, tied weights): importing that costs about 90 MB of
memory that a process keeps for its whole life, and the executor needs none of it once
the weights are read. So `serve-base` asks a short-lived child process for the load plan
(`python -m symbiont.base.plan DIR`: JSON on stdout) and reads the safetensors files
itself. A base with MoE experts stacks runs the model's own expert modules, so it loads
in-process as before.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from symbiont.base.executor import BaseExecutor, LoadPlan
from symbiont.model.checkpoint import CheckpointError

PLAN_TIMEOUT_S = 600.0  # a huge sharded checkpoint's fingerprint reads every shard
_ERROR_EXIT = 3  # the child's "the checkpoint or a flag is wrong: stderr says what"


def load(model: str, *, device="cpu", dtype=None) -> BaseExecutor:
    """The base executor of checkpoint folder `model`, loaded from a plan made in a child
    process (in this process for a base with experts stacks)."""
    plan = make_plan_in_child(model, dtype)
    if plan.experts:
        return BaseExecutor.from_pretrained(model, device=device, dtype=dtype)
    return BaseExecutor.from_plan(model, plan, device=device)


def make_plan_in_child(model: str, dtype=None) -> LoadPlan:
    """`LoadPlan.make(model, dtype)`, computed by `python -m symbiont.base.plan`."""
    command = [sys.executable, "-m", "symbiont.base.plan", str(model)]
    if dtype is not None:
        command += ["--dtype", str(dtype).removeprefix("torch.")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=PLAN_TIMEOUT_S)
    if done.returncode == _ERROR_EXIT:
        raise CheckpointError(done.stderr.strip())
    if done.returncode != 0:
        raise RuntimeError(
            f"planning the load of {model} failed (exit {done.returncode}):\n"
            f"{done.stderr.strip()[-4000:]}"
        )
    return LoadPlan.from_dict(json.loads(done.stdout))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m symbiont.base.plan",
        description="print, as JSON, which checkpoint keys a base executor reads for each "
        "frozen layer of a local checkpoint (used by serve-base)",
    )
    parser.add_argument("model", help="local Hugging Face checkpoint folder")
    parser.add_argument("--dtype", default=None, help="base dtype (default: the checkpoint's)")
    args = parser.parse_args(argv)
    try:
        plan = LoadPlan.make(args.model, args.dtype)
    except (CheckpointError, ValueError) as err:
        print(err, file=sys.stderr)
        return _ERROR_EXIT
    json.dump(plan.to_dict(), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
