"""serve-base loads its weights from a plan made in a child process, so its own process
never imports transformers' model machinery (symbiont.base.plan)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import symbiont
from symbiont.base.executor import LoadPlan
from symbiont.base.plan import load, make_plan_in_child
from symbiont.model.checkpoint import CheckpointError


def assert_same_executor(a, b):
    assert a.manifest == b.manifest
    ours, theirs = a.weight_tensors(), b.weight_tensors()
    assert len(ours) == len(theirs)
    for x, y in zip(ours, theirs, strict=True):
        assert x.shape == y.shape and x.stride() == y.stride() and torch.equal(x, y)
    assert layout(a) == layout(b), "the same layers share a block, at the same rows"


def layout(executor) -> list[tuple[int, int]]:
    """(which storage, offset in it) of each layer's weight: blocks hold sibling layers."""
    storages: dict[int, int] = {}
    places = []
    for w in executor._weights:
        storage = storages.setdefault(w.weight.untyped_storage().data_ptr(), len(storages))
        places.append((storage, w.weight.storage_offset()))
    return places


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_a_plan_made_in_a_child_loads_the_same_executor(arch, checkpoints):
    path = checkpoints(arch)
    reference = symbiont.BaseExecutor.from_pretrained(path)
    plan = make_plan_in_child(path)
    assert plan == LoadPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert_same_executor(symbiont.BaseExecutor.from_plan(path, plan), reference)
    assert_same_executor(load(path), reference)


def test_the_dtype_asked_for_reaches_the_plan(checkpoints):
    path = checkpoints("llama")
    executor = load(path, dtype="bfloat16")
    assert executor.manifest.dtype == torch.bfloat16
    assert_same_executor(executor, symbiont.BaseExecutor.from_pretrained(path, dtype="bfloat16"))


def test_a_plan_for_another_checkpoint_or_with_experts_is_refused(checkpoints):
    plan = LoadPlan.make(checkpoints("llama"))
    with pytest.raises(ValueError, match="another checkpoint"):
        symbiont.BaseExecutor.from_plan(checkpoints("gpt2"), plan)
    moe = LoadPlan.make(checkpoints("qwen2_moe"))
    assert moe.experts
    with pytest.raises(ValueError, match="experts stacks loads with from_pretrained"):
        symbiont.BaseExecutor.from_plan(checkpoints("qwen2_moe"), moe)


def test_a_base_with_experts_still_loads_in_process(checkpoints):
    path = checkpoints("qwen2_moe")
    assert_same_executor(load(path), symbiont.BaseExecutor.from_pretrained(path))


def test_a_bad_folder_is_the_same_clear_error_as_in_process(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="has no config.json; is it a Hugging Face"):
        load(str(tmp_path / "empty"))
    with pytest.raises(CheckpointError, match="does not exist"):
        load(str(tmp_path / "missing"))


def test_the_serving_process_imports_no_transformers_model_code(checkpoints):
    script = (
        "import sys, torch\n"
        "from symbiont.base.plan import load\n"
        "from symbiont.base.server import ExecutorServer\n"
        f"executor = load({str(checkpoints('llama'))!r})\n"
        "x = torch.ones(2, executor.manifest.layers[0].in_features)\n"
        "executor.forward(0, x)\n"
        "heavy = [m for m in ('transformers.modeling_utils', 'transformers.models.llama',\n"
        "    'transformers.core_model_loading', 'peft') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"imported in serve-base's process: {done.stdout}"
