"""Decode attention of the serving engine: reading K/V in place vs gathering it (issue 17).

    python benchmarks/decode_attention.py
    python benchmarks/decode_attention.py --heads 8 --kv-heads 4 --head-dim 16  # default model
    python benchmarks/decode_attention.py --seqs 16 --lengths 64,128,256,512 --layers 8

One layer's attention for `n` decoding sequences (one query each) with contexts of about
`L` tokens (lengths spread over [3L/4, L]), through the code paths of
`symbiont/serve/attention.py`, on one thread:

- gather, token-major: the path before this change (pool `[slots, kv_heads, hd]`, each
  sequence's blocks copied into a padded `[n, kv_heads, L, hd]` per layer, SDPA with
  `enable_gqa`), the baseline of every ratio;
- gather: today's fallback for sequences on scattered blocks (head-major pool, block
  gather, query heads folded onto their KV head);
- in place: sequences on aligned runs read as rows of one strided view of the pool, no
  copy; `in place, 2 rows/seq`: the same with one row computed for nothing per sequence
  (what sets the view's waste limit, MAX_ROWS_PER_SEQ in model_runner.py);
- per sequence: one SDPA call per sequence over a view of its run (no mask), the other
  way to read in place;
- in place, kernel / gather, kernel: the same two paths through symbiont's CPU decode
  kernel (symbiont/serve/decode_kernel.py), the engine's default on a CPU in float32.

`--layers N` builds N such cases (pools, queries) and times each variant over all N in
turn, as an engine step calls every layer once: each call then finds its pool out of the
caches, as in a real step, where a warm rerun of one case would find it cached.

Variants run interleaved, round after round, so machine load hits them alike; each
figure is the fastest of `--rounds` runs (ms per layer call). Ratios are against the
baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from symbiont.serve import decode_kernel
from symbiont.serve.attention import _group_attention
from symbiont.serve.context import AttnGroup, PoolRows

BLOCK = 16


def make_case(n: int, length: int, heads: int, kv_heads: int, hd: int, seed: int = 0):
    """The pools and attention groups of one decode step -> dict of variant -> callable."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(length - length // 4, length + 1, (n,), generator=g)
    lens[0] = length
    n_blocks = -(-length // BLOCK)
    align = 1 << (n_blocks - 1).bit_length()  # the size class of every run
    total = 2 * n * align  # room for a view with one wasted row per sequence
    slots = total * BLOCK
    pool_tm = torch.randn(slots, kv_heads, hd, generator=g)  # the old token-major layout
    v_tm = torch.randn(slots, kv_heads, hd, generator=g)
    pool_hm = pool_tm.transpose(0, 1).contiguous()  # [kv_heads, slots, hd]
    v_hm = v_tm.transpose(0, 1).contiguous()
    q = torch.randn(heads, n, hd, generator=g)  # [heads, n_tokens, hd]
    new = torch.randn(kv_heads, n, hd, generator=g)
    q_pos, kv_len = (lens - 1)[:, None], lens
    scattered = torch.randperm(total, generator=g)[: n * n_blocks]
    scale = hd**-0.5

    def gathered_group(blocks):
        return AttnGroup(n, 1, (0, n), None, blocks, n_blocks * BLOCK, q_pos, kv_len)

    def rows_group(rows_per_seq: int) -> AttnGroup:
        n_rows = n * rows_per_seq
        index = torch.arange(n) * rows_per_seq
        rq = torch.zeros(n_rows, 1, dtype=torch.long).index_copy_(0, index, q_pos)
        rl = torch.ones(n_rows, dtype=torch.long).index_copy_(0, index, kv_len)
        rows = PoolRows(0, align * BLOCK, n_rows, index)
        return AttnGroup(n, 1, (0, n), None, None, length, rq, rl, rows)

    kernel = decode_kernel.load()

    def run(group, kernel=None):
        return lambda: _group_attention(
            group, q, new, new, pool_hm, v_hm, BLOCK, scale, None, None, kernel
        )

    def old_gather():
        group = old
        kg = pool_tm.view(-1, BLOCK, kv_heads, hd).index_select(0, group.blocks)
        vg = v_tm.view(-1, BLOCK, kv_heads, hd).index_select(0, group.blocks)
        kg = kg.view(n, -1, kv_heads, hd).transpose(1, 2)
        vg = vg.view(n, -1, kv_heads, hd).transpose(1, 2)
        qg = q.view(heads, n, 1, hd).transpose(0, 1)
        mask = group.mask(None, q.dtype)
        out = F.scaled_dot_product_attention(
            qg, kg, vg, attn_mask=mask, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(n, heads, hd)

    runs_first = [i * 2 * align * BLOCK for i in range(n)]
    lengths = lens.tolist()
    qs = q.transpose(0, 1).reshape(n, kv_heads, heads // kv_heads, hd)

    def per_sequence():
        out = q.new_empty(n, kv_heads, heads // kv_heads, hd)
        for i in range(n):
            a, b = runs_first[i], runs_first[i] + lengths[i]
            out[i] = F.scaled_dot_product_attention(
                qs[i], pool_hm[:, a:b], v_hm[:, a:b], scale=scale
            )
        return out

    old = gathered_group(scattered)
    variants = {
        "gather, token-major (before)": old_gather,
        "gather": run(gathered_group(scattered)),
        "in place": run(rows_group(1)),
        "in place, 2 rows/seq": run(rows_group(2)),
        "per sequence": per_sequence,
    }
    if kernel is not None:
        variants["gather, kernel"] = run(gathered_group(scattered), kernel)
        variants["in place, kernel"] = run(rows_group(1), kernel)
    return variants


def measure(cases: list[dict], rounds: int) -> dict[str, float]:
    """ms per call of each variant: the best round, a round calling it once per case."""
    names = list(cases[0])
    best = dict.fromkeys(names, float("inf"))
    for case in cases:
        for fn in case.values():
            fn()  # warm up
    for _ in range(rounds):
        for name in names:
            start = time.perf_counter()
            for case in cases:
                case[name]()
            best[name] = min(best[name], (time.perf_counter() - start) / len(cases))
    return {name: t * 1e3 for name, t in best.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=4, help="query heads (small Llama: 4)")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seqs", default="8,32", help="decoding sequences, comma-separated")
    p.add_argument("--lengths", default="32,64,128,256,384,512,768")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--layers", type=int, default=1, help="cases timed in turn (see above)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if decode_kernel.load() is None:
        print(f"no kernel variants: {decode_kernel.unavailable_reason()}")
    print(
        f"heads {args.heads}, kv_heads {args.kv_heads}, head_dim {args.head_dim}, block {BLOCK}, "
        f"{args.layers} layer(s), {args.threads} thread(s)"
    )
    names = None
    with torch.inference_mode():
        for n in map(int, args.seqs.split(",")):
            for length in map(int, args.lengths.split(",")):
                cases = [
                    make_case(n, length, args.heads, args.kv_heads, args.head_dim, seed)
                    for seed in range(args.layers)
                ]
                ms = measure(cases, args.rounds)
                if names is None:
                    names = list(ms)
                    print("| seqs | context | " + " | ".join(names) + " |")
                    print("|---:|---:|" + "---:|" * len(names))
                base = ms[names[0]]
                cells = [f"{ms[names[0]]:.3f} ms"]
                cells += [f"{ms[k]:.3f} ms ({base / ms[k]:.1f}x)" for k in names[1:]]
                print(f"| {n} | {length} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
