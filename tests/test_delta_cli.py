"""`symbiont delta compress | merge | info` end to end on a really fine-tuned model.

The base is the embedded default model's architecture and tokenizer (unpretrained, built
once per session); the fine-tune trains every weight for a few AdamW steps on the bundled
fine-tuning set, so the delta is a real one (embedding rows of unseen tokens unchanged).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from symbiont.cli import main
from symbiont.delta import attach, load_delta
from symbiont.model.default import default_dataset


def fine_tune_all_weights(base_dir, out_dir, steps: int = 4):
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    records = [json.loads(line) for line in default_dataset().read_text().splitlines()[:64]]
    texts = [r["prompt"] + r["completion"] for r in records]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def compressed(model_dir, tmp_path_factory):
    """(base, fine-tuned, delta folder, stdout, stderr) of one `symbiont delta compress`."""
    root = tmp_path_factory.mktemp("delta-cli")
    finetuned = fine_tune_all_weights(model_dir, root / "ft")
    calib = root / "calib.jsonl"
    calib.write_text("\n".join(default_dataset().read_text().splitlines()[:80]))
    out, stdout, stderr = root / "delta", io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(
            [
                *("delta", "compress", "--base", str(model_dir), "--model", str(finetuned)),
                *("--out", str(out), "--calib", str(calib), "--calib-samples", "24"),
                *("--calib-seq-len", "32", "--zstd"),
            ]
        )
    assert code == 0, stderr.getvalue()
    return model_dir, finetuned, out, stdout.getvalue(), stderr.getvalue()


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_compress_info_merge_end_to_end(compressed, capsys, tmp_path):
    base, finetuned, out, stdout, stderr = compressed
    progress = [line for line in stderr.splitlines() if line.startswith("[")]
    assert len(progress) == 4 * 7 + 1, "one line per linear layer (lm_head included)"
    assert progress[0].startswith("[1/5] model.layers.0.self_attn.q_proj: relative output")
    assert progress[-1].startswith("[5/5] lm_head")
    assert "ratio" in stdout and "delta.safetensors.zst" in stdout

    code, stdout, _ = run(capsys, "delta", "info", str(out))
    assert code == 0
    assert "4-bit, sparsity 2:4, group size 128, zstd on" in stdout
    assert "model.layers.3.mlp.down_proj" in stdout and "[128 x 384] 4-bit 2:4" in stdout
    manifest = json.loads(run(capsys, "delta", "info", str(out), "--json")[1])
    assert manifest["compression"]["calibration_sequences"] == 24
    embed = next(p for p in manifest["params"] if p["name"] == "model.embed_tokens.weight")
    assert embed["kind"] == "fp16_rows_delta", "only rows of tokens seen in training changed"

    merged = tmp_path / "merged"
    code, stdout, stderr = run(
        capsys, "delta", "merge", "--base", str(base), "--delta", str(out), "--out", str(merged)
    )
    assert code == 0, stderr
    vanilla = AutoModelForCausalLM.from_pretrained(merged)  # plain transformers
    exact = AutoModelForCausalLM.from_pretrained(base)
    attach(exact, load_delta(out, base))
    assert (merged / "tokenizer.json").is_file()
    ids = AutoTokenizer.from_pretrained(merged)(["Q: What is 20 plus 19?\nA: 39"])["input_ids"]
    ids = torch.tensor(ids)
    with torch.no_grad():
        want, got = vanilla(ids).logits, exact(ids).logits
        ft = AutoModelForCausalLM.from_pretrained(finetuned)(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base)(ids).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    assert (want - ft).abs().mean() < 0.5 * (plain - ft).abs().mean()


def test_cli_refusals_say_why(compressed, capsys, tmp_path, checkpoints):
    base, finetuned, delta, _, _ = compressed
    out = tmp_path / "d"
    shutil.copytree(delta, out)
    other = checkpoints("llama")  # another model entirely
    code, _, stderr = run(
        capsys, "delta", "merge", "--base", str(other), "--delta", str(out), "--out",
        str(tmp_path / "m"),
    )  # fmt: skip
    assert code == 1 and "is another model" in stderr and not (tmp_path / "m").exists()

    args = ("--calib-samples", "8", "--calib-seq-len", "16")
    code, _, stderr = run(
        capsys, "delta", "compress", "--base", str(base), "--model", str(other),
        "--out", str(tmp_path / "x"), *args,
    )  # fmt: skip
    assert code == 1 and "shapes differ" in stderr and not (tmp_path / "x").exists()

    code, _, stderr = run(
        capsys, "delta", "compress", "--base", str(base), "--model", str(finetuned),
        "--out", str(out), *args,
    )  # fmt: skip
    assert code == 1 and "exists and is not an empty folder" in stderr
    assert "calibrating" not in stderr, "refused before tokenizing the calibration text"
    code, _, stderr = run(
        capsys, "delta", "compress", "--base", str(base), "--model", str(tmp_path / "nope"),
        "--out", str(tmp_path / "z"), *args,
    )  # fmt: skip
    assert code == 1 and "does not exist" in stderr and "calibrating" not in stderr

    data = out / "delta.safetensors.zst"
    data.write_bytes(data.read_bytes()[:-1])
    code, _, stderr = run(capsys, "delta", "info", str(out))
    assert code == 1 and "truncated or was modified" in stderr

    code, _, stderr = run(
        capsys, "delta", "compress", "--base", str(base), "--model", str(finetuned),
        "--out", str(tmp_path / "y"), "--calib-seq-len", "1000000",
    )  # fmt: skip
    assert code == 1 and "--calib-seq-len 1000000 is longer than the model's" in stderr
    assert "Traceback" not in stderr and not (tmp_path / "y").exists()

    (tmp_path / "a-file").write_text("")
    code, _, stderr = run(
        capsys, "delta", "compress", "--base", str(base), "--model", str(finetuned),
        "--out", str(tmp_path / "a-file" / "delta"), *args,
    )  # fmt: skip
    assert code == 1 and "a-file is not a folder this user can write in" in stderr
    assert "relative output error" not in stderr, "refused before compressing anything"

    sizeless = shutil.copytree(delta, tmp_path / "sizeless")
    record = json.loads((sizeless / "manifest.json").read_text())
    del record["sizes"]
    (sizeless / "manifest.json").write_text(json.dumps(record))
    code, _, stderr = run(capsys, "delta", "info", str(sizeless))
    assert code == 1 and "manifest.json lacks 'sizes'" in stderr and "Traceback" not in stderr

    with pytest.raises(SystemExit) as exit_info:
        main(["delta", "compress", "--base", "b", "--model", "m", "--out", "o", "--bits", "3"])
    assert exit_info.value.code == 2
    assert "invalid choice: 3" in capsys.readouterr().err
