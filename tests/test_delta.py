"""symbiont/delta: the solver, the packed format, the apply API and every refusal.

References: the solver against round-to-nearest of the same format on the layer output
error it minimises; the packed format against the solver's own dense result (bit exact);
`merge_checkpoint` + vanilla transformers against the exact apply path (`attach`), fp32,
within 1e-4.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from transformers import AutoModelForCausalLM

from symbiont.delta import (
    BaseMismatchError,
    CompressConfig,
    DeltaFormatError,
    attach,
    delta_product,
    load_delta,
    merge_checkpoint,
    merge_into,
)
from symbiont.delta.compress import compress
from symbiont.delta.format import MANIFEST, file_sha256
from symbiont.delta.packing import pack, pack_bits, unpack_bits
from symbiont.delta.solver import round_to_nearest, solve_obs
from symbiont.model.checkpoint import CheckpointError
from tests.tiny_models import ARCHS, VOCAB, Arch, build_checkpoint

# ---------------------------------------------------------------- the solver, one layer


def correlated_inputs(n: int, width: int, seed: int, sample_seed: int = 0) -> torch.Tensor:
    """Inputs [n, width] with correlated, unevenly scaled features, as real activations
    are (where OBS beats rounding); `seed` fixes the distribution, `sample_seed` the draw."""
    mixing = torch.randn(width, width, generator=torch.Generator().manual_seed(seed))
    scales = torch.linspace(0.2, 3.0, width)
    g = torch.Generator().manual_seed(1000 + sample_seed)
    noise = 0.1 * torch.randn(n, width, generator=g)
    return (torch.randn(n, width, generator=g) @ mixing / width**0.5 + noise) * scales


def output_error(delta, approx, x) -> float:
    """‖(Δ - Δ̃) X‖² / ‖Δ X‖²: the layer-output error on the calibration data."""
    return float(((x @ (delta - approx).T) ** 2).sum() / ((x @ delta.T) ** 2).sum())


FORMATS = [
    CompressConfig(bits=4, sparsity="2:4", group_size=128),
    CompressConfig(bits=2, sparsity="2:4", group_size=128),
    CompressConfig(bits=4, sparsity="2:4", group_size=0),
    CompressConfig(bits=4, sparsity="none", group_size=32),
    CompressConfig(bits=2, sparsity="none", group_size=0),
]


@pytest.mark.parametrize(
    "config", FORMATS, ids=lambda c: f"{c.bits}bit-{c.sparsity}-g{c.group_size}"
)
def test_solver_beats_round_to_nearest_on_layer_output(config):
    x = correlated_inputs(1024, 192, seed=0)  # 192 columns: two blocks, a partial group
    delta = torch.randn(48, 192, generator=torch.Generator().manual_seed(1)) * 1e-3
    hessian = x.T @ x / x.shape[0]
    obs = solve_obs(delta, hessian, config).dense()
    rtn = round_to_nearest(delta, config).dense()
    obs_error, rtn_error = output_error(delta, obs, x), output_error(delta, rtn, x)
    assert obs_error < 0.8 * rtn_error, f"OBS {obs_error:.4f} should beat RTN {rtn_error:.4f}"
    # and on held-out inputs of the same distribution, not only the calibration set
    held_out = correlated_inputs(512, 192, seed=0, sample_seed=1)
    assert output_error(delta, obs, held_out) < output_error(delta, rtn, held_out)


@pytest.mark.parametrize("method", [solve_obs, round_to_nearest])
@pytest.mark.parametrize("bits", [2, 4])
def test_two_four_pattern_holds_exactly(method, bits):
    config = CompressConfig(bits=bits, group_size=16)
    x = correlated_inputs(256, 64, seed=2)
    delta = torch.randn(24, 64) * 1e-2
    args = (delta, x.T @ x / 256, config) if method is solve_obs else (delta, config)
    solved = method(*args)
    per_quad = solved.kept.reshape(24, 16, 4).sum(dim=2)
    assert bool((per_quad == 2).all()), "every group of 4 input columns keeps exactly 2"
    dense = solved.dense()
    assert bool((dense[~solved.kept] == 0).all()), "pruned positions must be exactly 0"
    assert int((dense.reshape(24, 16, 4) != 0).sum(dim=2).max()) <= 2
    assert int(solved.codes.max()) < 2**bits


def test_dead_input_columns_and_zero_delta_are_handled():
    x = correlated_inputs(256, 32, seed=3)
    x[:, 5] = 0  # an input never active in calibration: H has a zero diagonal entry
    hessian = x.T @ x / 256
    solved = solve_obs(torch.randn(8, 32) * 1e-3, hessian, CompressConfig(group_size=16))
    assert torch.isfinite(solved.dense()).all()
    zero = solve_obs(torch.zeros(8, 32), hessian, CompressConfig(group_size=16)).dense()
    assert bool((zero == 0).all()), "an unchanged layer must decompress to an exact zero delta"


# ---------------------------------------------------------------- packing


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("n", [1, 3, 8, 13, 64])
def test_pack_bits_roundtrip(bits, n):
    values = torch.randint(0, 2**bits, (5, n), dtype=torch.uint8)
    packed = pack_bits(values, bits)
    assert packed.shape == (5, -(-n * bits // 8))
    assert torch.equal(unpack_bits(packed, bits, n), values)


@pytest.mark.parametrize(
    "config", FORMATS, ids=lambda c: f"{c.bits}bit-{c.sparsity}-g{c.group_size}"
)
@pytest.mark.parametrize("columns", [40, 200, 256])  # 200 % 128 != 0: a partial last group
def test_pack_unpack_is_exact(config, columns):
    x = correlated_inputs(256, columns, seed=4)
    solved = solve_obs(torch.randn(12, columns) * 1e-3, x.T @ x / 256, config)
    packed = pack("layer", solved, two_four=config.sparsity == "2:4")
    packed.validate()
    assert torch.equal(packed.dense(), solved.dense()), (
        "unpacked Δ̃ must equal the solver's bit for bit"
    )
    assert torch.equal(packed.kept(), solved.kept)
    for dtype in (torch.float32, torch.bfloat16):  # the fast paths serving runs per call
        assert torch.equal(packed.dense(dtype), packed.dense_reference(dtype))
        assert torch.equal(packed.serving().dense(dtype), packed.dense_reference(dtype))
    assert packed.serving().nbytes() == packed.nbytes(), "serving holds the same bytes"
    # the stored size is what the format promises: bits per kept value plus the mask
    kept = columns // 2 if config.sparsity == "2:4" else columns
    assert packed.codes.numel() == 12 * -(-kept * config.bits // 8)


def test_packed_size_of_four_bit_two_four():
    """4-bit 2:4 with groups of 128: 2 bits of values + 1 bit of mask + scales per weight."""
    solved = round_to_nearest(torch.randn(256, 1024) * 1e-3, CompressConfig())
    packed = pack("layer", solved, two_four=True)
    fp16 = 256 * 1024 * 2
    bits_per_weight = packed.nbytes() * 8 / (256 * 1024)
    assert bits_per_weight == pytest.approx(3 + 24 / 128)  # bf16 scale + uint8 zero per 128
    assert fp16 / packed.nbytes() > 5


# ---------------------------------------------------------------- whole models


def perturbed_copy(base_dir, out_dir, seed: int):
    """A deterministic 'full fine-tune': every weight moved a little, a few embedding rows."""
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "embed_tokens" in name:
                param[:12] += 0.05 * torch.randn(param[:12].shape, generator=g)
            else:
                param += 0.05 * param.std() * torch.randn(param.shape, generator=g)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def pair(tmp_path_factory, checkpoints):
    """(base, fine-tuned, compressed delta folder, calibration ids)."""
    root = tmp_path_factory.mktemp("delta")
    base = checkpoints("llama")
    finetuned = perturbed_copy(base, root / "ft", seed=1)
    calibration = torch.randint(0, VOCAB, (32, 24), generator=torch.Generator().manual_seed(2))
    reports = []
    compress(
        base,
        finetuned,
        root / "delta",
        calibration,
        CompressConfig(group_size=16),
        progress=reports.append,
    )
    return base, finetuned, root / "delta", calibration, reports


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_compress_solves_every_linear_layer_with_progress(pair):
    base, finetuned, delta_dir, _, reports = pair
    delta = load_delta(delta_dir, base)
    model = AutoModelForCausalLM.from_pretrained(base)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(delta.layers) == linears, "every nn.Linear, the output projection included"
    assert [r.name for r in reports] == [layer["name"] for layer in delta.manifest["layers"]]
    assert all(0 <= r.relative_error < 0.5 for r in reports)
    # norms changed (full fp16 deltas); the embedding only in its first 12 rows
    embed = delta.params["model.embed_tokens.weight"]
    assert embed.rows.tolist() == list(range(12))
    assert "model.norm.weight" in delta.params
    sizes = delta.manifest["sizes"]
    assert sizes["linear_fp16_bytes"] / sizes["linear_packed_bytes"] > 3.5


def test_merged_checkpoint_equals_exact_apply(pair, tmp_path):
    base, finetuned, delta_dir, _, _ = pair
    merged_dir = merge_checkpoint(base, delta_dir, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)  # vanilla transformers
    exact = AutoModelForCausalLM.from_pretrained(base)
    attach(exact, load_delta(delta_dir, base))
    ids = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(5))
    got, want = logits(exact, ids), logits(merged, ids)
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    # and the variant is the fine-tune, approximately: far closer than the base is
    ft = logits(AutoModelForCausalLM.from_pretrained(finetuned), ids)
    plain = logits(AutoModelForCausalLM.from_pretrained(base), ids)
    assert (want - ft).abs().mean() < 0.25 * (plain - ft).abs().mean()


def test_delta_product_is_x_times_dense_delta(pair):
    base, _, delta_dir, _, _ = pair
    layer = load_delta(delta_dir).layers["model.layers.0.mlp.down_proj"]
    x = torch.randn(2, 5, layer.shape[1], dtype=torch.float64)
    got = delta_product(x, layer)
    assert got.shape == (2, 5, layer.shape[0]) and got.dtype == torch.float64
    assert torch.allclose(got, x @ layer.dense(torch.float64).T)
    with pytest.raises(ValueError, match="takes 64"):
        delta_product(torch.randn(3, 32), layer)


def test_rtn_delta_is_worse_than_obs_on_the_model(pair, tmp_path):
    base, finetuned, delta_dir, calibration, _ = pair
    compress(
        base, finetuned, tmp_path / "rtn", calibration, CompressConfig(group_size=16, method="rtn")
    )
    ft = AutoModelForCausalLM.from_pretrained(finetuned)
    ids = calibration[:8]
    want = torch.log_softmax(logits(ft, ids), -1)

    def divergence(folder):
        model = AutoModelForCausalLM.from_pretrained(base)
        merge_into(model, load_delta(folder))
        got = torch.log_softmax(logits(model, ids), -1)
        return float((want.exp() * (want - got)).sum(-1).mean())  # KL(ft || variant)

    assert divergence(delta_dir) < divergence(tmp_path / "rtn")


# ---------------------------------------------------------------- refusals


def copy_delta(delta_dir, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(delta_dir, target)
    return target


def data_file(folder):
    return next(p for p in folder.iterdir() if p.name.startswith("delta.safetensors"))


def rewrite(folder, edit_tensors=None, edit_manifest=None):
    """Change the data file and/or manifest, keeping the file hash consistent, so only
    the check under test can fire."""
    manifest = json.loads((folder / MANIFEST).read_text())
    file = data_file(folder)
    if edit_tensors is not None:
        tensors = load_safetensors(file.read_bytes())
        edit_tensors(tensors)
        file.write_bytes(save_safetensors(tensors))
        manifest["files"] = {file.name: {"sha256": file_sha256(file), "bytes": file.stat().st_size}}
    if edit_manifest is not None:
        edit_manifest(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest))


def test_refuses_another_base(pair, tmp_path):
    _, _, delta_dir, _, _ = pair
    other = build_checkpoint(ARCHS["llama"], tmp_path / "other", seed=7)
    with pytest.raises(BaseMismatchError, match="compressed against base .* is another model"):
        load_delta(delta_dir, other)
    with pytest.raises(BaseMismatchError, match="is another model"):
        merge_checkpoint(other, delta_dir, tmp_path / "merged")
    assert not (tmp_path / "merged").exists(), "nothing written for a refused merge"


def test_refuses_same_fingerprint_but_other_weights_on_merge(pair, tmp_path, monkeypatch):
    base, _, delta_dir, _, _ = pair
    copy = copy_delta(delta_dir, tmp_path)
    rewrite(copy, edit_manifest=lambda m: m["base"].update(weights_sha256="0" * 64))
    with pytest.raises(BaseMismatchError, match="weights sha256 differs"):
        merge_checkpoint(base, copy, tmp_path / "merged")


def test_refuses_truncated_file(pair, tmp_path):
    copy = copy_delta(pair[2], tmp_path)
    file = data_file(copy)
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(DeltaFormatError, match="truncated or was modified"):
        load_delta(copy)


def test_refuses_tampered_file(pair, tmp_path):
    copy = copy_delta(pair[2], tmp_path)
    file = data_file(copy)
    data = bytearray(file.read_bytes())
    data[-7] ^= 0x10  # same size, one bit flipped in a packed value
    file.write_bytes(bytes(data))
    with pytest.raises(DeltaFormatError, match="tampered with or corrupted"):
        load_delta(copy)


def test_refuses_unknown_bit_width(pair, tmp_path):
    copy = copy_delta(pair[2], tmp_path)
    rewrite(copy, edit_manifest=lambda m: m["layers"][3].update(bits=3))
    with pytest.raises(DeltaFormatError, match="unknown bit width 3"):
        load_delta(copy)


def test_refuses_mask_that_is_not_two_four(pair, tmp_path):
    copy = copy_delta(pair[2], tmp_path)
    name = "model.layers.1.self_attn.o_proj.mask"

    def break_mask(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name][2, 1] = 0b0111_0011  # second nibble keeps 3 of 4

    rewrite(copy, edit_tensors=break_mask)
    with pytest.raises(DeltaFormatError, match=r"mask is not 2:4 \(row 2, columns 12..15 keep 3"):
        load_delta(copy)


def test_refuses_sparsity_the_mask_does_not_match(pair, tmp_path):
    copy = copy_delta(pair[2], tmp_path)
    rewrite(copy, edit_manifest=lambda m: m["layers"][0].update(sparsity="none"))
    with pytest.raises(DeltaFormatError, match="says sparsity none but the file holds a mask"):
        load_delta(copy)
    copy = copy_delta(pair[2], tmp_path / "2")
    name = "model.layers.0.self_attn.q_proj.mask"
    rewrite(copy, edit_tensors=lambda tensors: tensors.pop(name))
    with pytest.raises(DeltaFormatError, match=f"tensor '{name}' named by the manifest is not"):
        load_delta(copy)


def test_refuses_missing_or_foreign_manifest(tmp_path, pair):
    with pytest.raises(DeltaFormatError, match="no manifest.json"):
        load_delta(tmp_path)
    copy = copy_delta(pair[2], tmp_path)
    rewrite(copy, edit_manifest=lambda m: m.update(version=99))
    with pytest.raises(DeltaFormatError, match="format version 99"):
        load_delta(copy)


def test_refuses_model_whose_shapes_differ(pair, tmp_path):
    base, finetuned, delta_dir, calibration, _ = pair
    wider = Arch("llama-wide", "llama", {**ARCHS["llama"].config, "intermediate_size": 96}, (), ())
    wide_dir = build_checkpoint(wider, tmp_path / "wide")
    with pytest.raises(CheckpointError, match="shapes differ"):
        compress(base, wide_dir, tmp_path / "out", calibration, CompressConfig())
    assert not (tmp_path / "out").exists()
    # applying onto a model of other shapes changes nothing, even for layers that fit
    model = AutoModelForCausalLM.from_pretrained(wide_dir)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(
        DeltaFormatError, match="layer model.layers.0.mlp.gate_proj is \\[96, 32\\]"
    ):
        merge_into(model, load_delta(delta_dir))
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())


def test_zstd_stage_roundtrips_and_is_smaller(pair, tmp_path):
    base, finetuned, delta_dir, calibration, _ = pair
    compress(base, finetuned, tmp_path / "z", calibration, CompressConfig(group_size=16, zstd=True))
    plain, packed = load_delta(delta_dir), load_delta(tmp_path / "z")
    assert data_file(tmp_path / "z").name == "delta.safetensors.zst"
    assert data_file(tmp_path / "z").stat().st_size < data_file(delta_dir).stat().st_size
    for name, layer in plain.layers.items():  # same calibration, same solver: same bytes
        assert torch.equal(layer.dense(), packed.layers[name].dense())


# ---------------------------------------------------------------- calibration text


def test_calibration_windows_spread_and_refuse_short_text(tmp_path):
    from symbiont.delta.calibration import calibration_windows, read_texts

    windows = calibration_windows(list(range(100)), samples=5, seq_len=20)
    assert windows[:, 0].tolist() == [0, 20, 40, 60, 80] and windows.shape == (5, 20)
    assert calibration_windows(list(range(22)), samples=256, seq_len=20).shape == (3, 20)
    with pytest.raises(ValueError, match="has 5 tokens, fewer than --calib-seq-len 20"):
        calibration_windows(list(range(5)), samples=4, seq_len=20)
    data = tmp_path / "c.jsonl"
    data.write_text(
        '{"text": "a"}\n{"prompt": "b", "completion": "c"}\n'
        '{"messages": [{"role": "user", "content": "d"}, {"role": "assistant", "content": "e"}]}\n'
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "f"}]}]}\n'
    )
    assert read_texts(data) == ["a", "bc", "d\ne", "f"]  # OpenAI's parts: their text
    data.write_text('{"other": 1}\n')
    with pytest.raises(ValueError, match="c.jsonl:1 has none of 'text'"):
        read_texts(data)
    with pytest.raises(ValueError, match="is not a file"):
        read_texts(tmp_path / "missing.txt")


@pytest.mark.parametrize("arch", ["qwen2", "gemma2", "gpt_neox"])
def test_other_architectures_merge_equals_exact_apply(arch, checkpoints, tmp_path):
    """Biases (qwen2), tied embeddings and soft-capping (gemma2), renamed checkpoint keys
    and another layer layout (gpt_neox: lm_head saved as embed_out)."""
    base = checkpoints(arch)
    finetuned = perturbed_copy(base, tmp_path / "ft", seed=3)
    calibration = torch.randint(0, VOCAB, (8, 16), generator=torch.Generator().manual_seed(4))
    compress(base, finetuned, tmp_path / "d", calibration, CompressConfig(group_size=16))
    merged = AutoModelForCausalLM.from_pretrained(
        merge_checkpoint(base, tmp_path / "d", tmp_path / "m")
    )
    exact = AutoModelForCausalLM.from_pretrained(base)
    attach(exact, load_delta(tmp_path / "d", base))
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(6))
    got, want = logits(exact, ids), logits(merged, ids)
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    ft = logits(AutoModelForCausalLM.from_pretrained(finetuned), ids)
    plain = logits(AutoModelForCausalLM.from_pretrained(base), ids)
    assert (want - ft).abs().mean() < 0.25 * (plain - ft).abs().mean()


def test_refuses_conv1d_models(checkpoints, tmp_path):
    base = checkpoints("gpt2")
    calibration = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(CheckpointError, match="Conv1D layers .* plain nn.Linear layers only"):
        compress(base, base, tmp_path / "d", calibration, CompressConfig())


def test_memory_holds_one_decoder_layer_at_a_time(pair, tmp_path, monkeypatch):
    """While a layer is solved, every other decoder layer is on the meta device."""
    from symbiont.delta import compress as compress_module

    base, finetuned, _, calibration, _ = pair
    seen = []
    solve = compress_module._Run._solve_linear

    def spy(self, index, total, name, module, hessian):
        layers = compress_module.decoder_layers(self.model)
        real = [i for i, layer in enumerate(layers) if not layer.self_attn.q_proj.weight.is_meta]
        seen.append((index, real))
        return solve(self, index, total, name, module, hessian)

    monkeypatch.setattr(compress_module._Run, "_solve_linear", spy)
    compress(base, finetuned, tmp_path / "d", calibration[:4], CompressConfig(group_size=16))
    decoder = [(index, real) for index, real in seen if index < 2]
    assert decoder and all(real == [index] for index, real in decoder), seen
    assert seen[-1] == (2, []), "the output projection is solved with every layer released"


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.pop("layers"),
        lambda m: m.update(params={"a": 1}),
        lambda m: m.update(files=[]),
        lambda m: m["layers"].append(7),
        lambda m: m["layers"][0].pop("shape"),
        lambda m: m["layers"][0].update(shape=[4, 4, 4]),
        lambda m: m["layers"][0].update(shape=[0, 32]),
        lambda m: m["layers"][0].update(shape=[32, 64]),
        lambda m: m["layers"][0].update(group_size="x"),
        lambda m: m["layers"][0].update(sparsity="4:8"),
        lambda m: m["params"][0].pop("kind"),
        lambda m: m["params"][0].update(kind="int8"),
        lambda m: m["params"][0].update(shape=[1, 2, 3]),
        lambda m: m["params"][0].update(name="nowhere"),
        lambda m: m.update(format="other"),
    ],
)
def test_any_malformed_manifest_is_a_clear_refusal(pair, tmp_path, edit):
    copy = copy_delta(pair[2], tmp_path)
    rewrite(copy, edit_manifest=edit)
    with pytest.raises(DeltaFormatError):
        load_delta(copy)


def sparsegpt_reference(w, hessian, bits, blocksize=128, percdamp=0.01, prunen=2, prunem=4):
    """SparseGPT's `fasterprune` with GPTQ's asymmetric per-row quantizer, transcribed from
    the published code (IST-DASLab/sparsegpt, sparsegpt.py and quant.py), plus our one
    deliberate change: each scale rounded to bfloat16, as our format stores it."""
    w = w.clone().float()
    h = hessian.clone()
    maxq = 2**bits - 1
    xmin = torch.minimum(w.min(1).values, torch.zeros(w.shape[0]))
    xmax = torch.maximum(w.max(1).values, torch.zeros(w.shape[0]))
    both = (xmin == 0) & (xmax == 0)
    xmin[both], xmax[both] = -1, 1
    scale = ((xmax - xmin) / maxq).bfloat16().float()[:, None]
    zero = torch.round(-xmin[:, None] / scale)

    def quantize(x):
        q = torch.clamp(torch.round(x / scale) + zero, 0, maxq)
        return scale * (q - zero)

    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h[range(len(h)), range(len(h))] += percdamp * torch.mean(torch.diag(h))
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    columns = w.shape[1]
    for i1 in range(0, columns, blocksize):
        i2 = min(i1 + blocksize, columns)
        w1 = w[:, i1:i2].clone()
        q1 = torch.zeros_like(w1)
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        mask1 = torch.zeros_like(w1) == 1
        for i in range(i2 - i1):
            col = w1[:, i]
            d = hinv1[i, i]
            if i % prunem == 0:
                tmp = (
                    w1[:, i : i + prunem] ** 2
                    / (torch.diag(hinv1)[i : i + prunem].reshape((1, -1))) ** 2
                )
                mask1.scatter_(1, i + torch.topk(tmp, prunen, dim=1, largest=False)[1], True)
            q = col.clone()
            q[mask1[:, i]] = 0
            q = quantize(q.unsqueeze(1)).flatten()
            q1[:, i] = q
            err = (col - q) / d
            w1[:, i:] -= err.unsqueeze(1).matmul(hinv1[i, i:].unsqueeze(0))
            err1[:, i] = err
        w[:, i1:i2] = q1
        w[:, i2:] -= err1.matmul(hinv[i1:i2, i2:])
    return w


@pytest.mark.parametrize("bits", [2, 4])
def test_solver_matches_the_sparsegpt_reference(bits):
    x = correlated_inputs(512, 256, seed=5)
    delta = torch.randn(32, 256, generator=torch.Generator().manual_seed(6)) * 1e-3
    hessian = x.T @ x / 512
    want = sparsegpt_reference(delta, hessian, bits)
    got = solve_obs(delta, hessian, CompressConfig(bits=bits, group_size=0)).dense()
    assert torch.allclose(got, want, rtol=0, atol=1e-9), (got - want).abs().max()


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        ("lm_head.weight", float("nan"), "holds NaN or infinite values"),
        ("model.embed_tokens.weight", float("inf"), "holds NaN or infinite values"),
        ("model.norm.weight", 1e6, "beyond what its fp16 delta can hold"),
    ],
)
def test_refuses_non_finite_or_out_of_range_fine_tunes(pair, tmp_path, where, value, message):
    """A NaN in a row the calibration never reads, or a change fp16 cannot hold, was
    compressed silently (and merged into NaN or inf weights); now it is refused by name."""
    from safetensors.torch import load_file, save_file

    base, finetuned, _, calibration, _ = pair
    broken = shutil.copytree(finetuned, tmp_path / "broken")
    tensors = load_file(broken / "model.safetensors")
    tensors[where][-1, ...] = value  # the last embedding row: no calibration token reads it
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{re.escape(where)}.*{message}"):
        compress(base, broken, tmp_path / "out", calibration, CompressConfig(group_size=16))
    assert not (tmp_path / "out").exists()


def test_refuses_a_fine_tune_whose_config_changed(pair, tmp_path):
    """A context-extension fine-tune (another rope_theta) compressed silently, and merging
    served it with the base's config: the fine-tune's weights, the base's positions."""
    base, finetuned, _, calibration, _ = pair
    changed = shutil.copytree(finetuned, tmp_path / "changed")
    record = json.loads((changed / "config.json").read_text())
    record.setdefault("rope_parameters", {})["rope_theta"] = 10.0
    record["rope_theta"] = 10.0
    record["transformers_version"] = "0.0.0"  # noise: never named
    (changed / "config.json").write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="changes its config.*rope") as caught:
        compress(base, changed, tmp_path / "out", calibration, CompressConfig(group_size=16))
    assert "transformers_version" not in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_refuses_embedding_rows_listed_twice(pair, tmp_path):
    """`merged[rows] += delta` applies one of two deltas of a repeated row: refused."""
    copy = copy_delta(pair[2], tmp_path)
    name = "model.embed_tokens.weight.rows"

    def repeat_a_row(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name][1] = tensors[name][0]

    rewrite(copy, edit_tensors=repeat_a_row)
    with pytest.raises(DeltaFormatError, match="model.embed_tokens.weight: stored tensors"):
        load_delta(copy)
