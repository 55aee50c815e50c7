"""The attack table of docs/privacy.md: what a curious executor recovers from masked calls.

1. Principal components over a recording: the pretrained default model (real, anisotropic
   activations) runs LoRA training steps on its corpus through a recording executor, per
   mode and pool size K; for 1, 4 and 16 observed steps the best |r| with the true
   activations and gradients of any principal-component estimate (keep or remove the top
   k components, k up to K + 1) is printed, worst layer first, plus the best single
   received tensor. Unmasked, every attack reads |r| = 1.
2. Dictionary decoding of first-layer inputs at a real width: normalised embeddings of
   random tokens (std 0.02, like an initialised LLM) masked as each mode masks them; the
   executor decodes each row to the nearest vocabulary entry (after projecting away the
   pool's subspace, which it finds by principal components). Token recovery rate per
   noise scale (`noise_scale`, grown with the width as the client grows it).
3. Label recovery from the logits' gradient (backward through the LM head): the argmin
   of each received row against the next token. Usage:

    python benchmarks/masking_attacks.py [--width 4096 --vocab 4096]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import peft
import torch

import symbiont
from symbiont.client.masking import MaskConfig, noise_scale

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.masking_attacks import (  # noqa: E402 - the shared attack code of the tests
    Recorder,
    layers_of,
    pca_attack,
    single_tensor_attack,
    stacked,
)

STEPS = (1, 4, 16)


def record(path, mask, batches) -> list:
    """What the (first) executor received over the training steps, or the truth."""
    executors = [Recorder(symbiont.BaseExecutor.from_pretrained(path)) for _ in range(2)]
    pair = tuple(executors) if mask is not None and mask.mode == "shares" else executors[0]
    model = symbiont.load_client(path, pair, mask_activations=mask)
    torch.manual_seed(1)
    config = peft.LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False)
    model = peft.get_peft_model(model, config)
    for ids in batches:
        model(input_ids=ids, labels=ids).loss.backward()
    return executors[0].calls


def corpus_batches(path, steps: int, batch: int, seq: int) -> list[torch.Tensor]:
    from transformers import AutoTokenizer

    from symbiont.model.default import default_dataset

    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(default_dataset().read_text())["input_ids"]
    per = batch * seq
    assert len(ids) >= steps * per, "corpus too short for this many steps"
    return [torch.tensor(ids[i * per : (i + 1) * per]).view(batch, seq) for i in range(steps)]


def pca_table(args) -> None:
    path = symbiont.default_model()
    batches = corpus_batches(path, max(STEPS), args.batch, args.seq)
    truth = record(path, None, batches)
    per_step = len(truth) // max(STEPS)
    modes = [("shares", MaskConfig("shares"))]
    modes += [(f"pool K={k}", MaskConfig("pool", pool_size=k)) for k in args.pool_sizes]
    print(
        f"default model (hidden 128, MLP 384, vocab 2048), {args.batch}x{args.seq} tokens "
        f"per step; |r| of the best attack, worst layer"
    )
    print(f"{'mode':<14}{'single':>8}" + "".join(f"{f'PCA {s} st.':>13}" for s in STEPS))
    for name, mask in modes:
        received = record(path, mask, batches)
        row = [single_tensor_attack(received, truth)]
        for steps in STEPS:
            seen, true = received[: steps * per_step], truth[: steps * per_step]
            worst = 0.0
            for op, layer in layers_of(seen):
                recording = stacked(seen, op, layer)
                ks = {1, 4, 16, 64, mask.pool_size, mask.pool_size + 1}
                ks = sorted(k for k in ks if k < recording.shape[1])
                scores = pca_attack(recording, stacked(true, op, layer), ks)
                worst = max(worst, *scores.values())
            row.append(worst)
        print(f"{name:<14}" + "".join(f"{r:>8.3f}" if i == 0 else f"{r:>13.3f}" for i, r in enumerate(row)))  # fmt: skip


def decoding_table(args) -> None:
    generator = torch.Generator().manual_seed(0)
    vocab = torch.randn(args.vocab, args.width, generator=generator) * 0.02
    table = vocab / vocab.pow(2).mean(dim=1, keepdim=True).sqrt()  # RMSNorm, weight 1
    tokens = torch.randint(0, args.vocab, (args.tokens,), generator=generator)
    x = table[tokens]  # [tokens, width], what the first layer reads
    rms = x.pow(2).mean().sqrt()
    basis = torch.linalg.qr(torch.randn(args.width, 16, generator=generator)).Q.T  # [16, width]
    print(
        f"\nfirst-layer dictionary decoding: width {args.width}, vocab {args.vocab}, "
        f"{args.tokens} tokens; share of tokens recovered (chance {1 / args.vocab:.2%})"
    )
    print(
        f"{'noise_scale':>12}{'shares':>10}{'pool K=16':>12}  (x {noise_scale(1, args.width):g} at this width)"
    )
    for base in args.scales:
        scale = noise_scale(base, args.width)
        noise = torch.randn(x.shape, generator=generator) * rms * scale
        coefficients = torch.randn(len(x), 16, generator=generator) * rms * scale
        pooled = x + coefficients * (args.width / 16) ** 0.5 @ basis
        rates = [_decode_rate(x + noise, table, tokens), _decode_rate(_project_away(pooled, 16), table, tokens)]  # fmt: skip
        print(f"{base:>12g}" + "".join(f"{r:>10.1%}" if i == 0 else f"{r:>12.1%}" for i, r in enumerate(rates)))  # fmt: skip


def label_table(args) -> None:
    """Backward through the LM head sends the logits' gradient, softmax - onehot(label)
    per token: one coordinate stands out, and it names the next token of the text."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(args.tokens, args.label_vocab, generator=generator) * 2
    labels = torch.randint(0, args.label_vocab, (args.tokens,), generator=generator)
    grad = torch.softmax(logits, dim=1) - torch.nn.functional.one_hot(labels, args.label_vocab)
    rms = grad.pow(2).mean().sqrt()
    print(
        f"\nlogits-gradient label recovery (argmin of each received row): vocab "
        f"{args.label_vocab}, {args.tokens} tokens (chance {1 / args.label_vocab:.3%})"
    )
    print(f"{'noise_scale':>12}{'effective':>11}{'shares':>10}")
    for base in args.scales:
        scale = noise_scale(base, args.label_vocab)
        received = grad + torch.randn(grad.shape, generator=generator) * rms * scale
        rate = float((received.argmin(dim=1) == labels).float().mean())
        print(f"{base:>12g}{scale:>11.0f}{rate:>10.1%}")


def _project_away(received: torch.Tensor, k: int) -> torch.Tensor:
    centred = received - received.mean(dim=0)
    top = torch.linalg.svd(centred, full_matrices=False).Vh[:k]
    return received - received @ top.T @ top


def _decode_rate(received, table, tokens) -> float:
    guesses = torch.cdist(received, table).argmin(dim=1)
    return float((guesses == tokens).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--pool-sizes", type=int, nargs="+", default=[2, 16, 64, 512])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--label-vocab", type=int, default=32000)
    parser.add_argument("--only", choices=("pca", "decoding"), default=None)
    parser.add_argument("--scales", type=float, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.only != "decoding":
        pca_table(args)
    if args.only != "pca":
        decoding_table(args)
        label_table(args)


if __name__ == "__main__":
    main()
