"""What a compiled decoder would buy `symbiont serve` on a CPU (issue 17).

    python benchmarks/compiled_bound.py --model 100m --batch 16

Three ways to run the same base-only decode step (one new token for each of `--batch`
sequences, fp32, one torch thread, contexts of `--prompt-len` + about `--steps` / 2):

1. `engine`: `symbiont serve`'s engine without HTTP (packed weights, lean forward, paged
   KV cache, sampling and bookkeeping): ms per decode step.
2. `eager loop`: the least a Python decoder can do: one module per layer with q/k/v and
   gate/up as one matmul each, oneDNN's packed linear (as the engine's), `F.rms_norm`,
   rotary on q and k together, and one SDPA call per layer over a strided view of a K/V
   pool (as the engine's in-place read). Random weights of the checkpoint's shapes; no
   adapters, sampling or KV writes.
3. `compiled loop`: the same module through `torch.compile` (inductor, `freezing`: weights
   packed by inductor, elementwise ops fused into C++ kernels, no per-module Python;
   attention stays one opaque call, as vLLM's is a kernel of its own). Needs a C++
   compiler; without one this arm prints SKIP with the reason.

Arms run in turn for `--rounds` rounds (best round counts), and the script prints ms per
step and the ratios. `compiled loop / eager loop` bounds what compiling the decoder could
save; `eager loop / engine` is what the engine spends beyond a minimal Python loop.

--model: 'small' (4.0M), '100m' (97.5M), '500m' (0.50B): head_dim-64 Llamas built like
benchmarks/peers/vllm_cpu.py's into --out; or a Llama checkpoint folder.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks" / "peers"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402, N812 - torch's own alias
from torch import nn  # noqa: E402

POOL_ROWS = 64  # K/V pool row stride, in positions (a power of two >= the context)


class Decoder(nn.Module):
    """[n] token ids -> [n, vocab] logits of n decoding sequences (one token each)."""

    def __init__(self, config, context: int, packed: bool):
        super().__init__()
        hidden, self.heads = config.hidden_size, config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = hidden // self.heads
        self.eps = config.rms_norm_eps
        self.embed = nn.Embedding(config.vocab_size, hidden)
        self.layers = nn.ModuleList(
            Layer(config, i, self.head_dim) for i in range(config.num_hidden_layers)
        )
        self.norm = nn.Parameter(torch.ones(hidden))
        self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.data.mul_(0.05)
                # packed once, as symbiont/base/prepack.py does; read only by packed=True
                module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.data, 32)
        self.packed = packed
        self.context = context

    def forward(self, ids, cos, sin, mask, pools):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(self, h, cos, sin, mask, pools)
        return self.linear(F.rms_norm(h, h.shape[-1:], self.norm, self.eps), self.lm_head)

    def linear(self, x, module):
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, module.packed, None, "none", [], "")
        return F.linear(x, module.weight)


class Layer(nn.Module):
    def __init__(self, config, index: int, head_dim: int):
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.index, self.sizes = index, [heads * head_dim, kv_heads * head_dim] * 1
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, hidden, bias=False)
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)
        self.norm1 = nn.Parameter(torch.ones(hidden))
        self.norm2 = nn.Parameter(torch.ones(hidden))

    def forward(self, top: Decoder, h, cos, sin, mask, pools):
        heads, kv_heads, hd = top.heads, top.kv_heads, top.head_dim
        x = F.rms_norm(h, h.shape[-1:], self.norm1, top.eps)
        q, k, _ = top.linear(x, self.qkv).split([heads * hd, kv_heads * hd, kv_heads * hd], -1)
        qk = torch.cat((q.view(-1, heads, hd), k.view(-1, kv_heads, hd)), 1)
        half = hd // 2
        qk = qk * cos[:, None] + torch.cat((-qk[..., half:], qk[..., :half]), -1) * sin[:, None]
        queries = qk[:, :heads].reshape(-1, heads * hd).contiguous()
        h = h + top.linear(
            torch.ops.compiled_bound.attend(queries, mask, pools[self.index]), self.o
        )
        x = F.rms_norm(h, h.shape[-1:], self.norm2, top.eps)
        gate, up = top.linear(x, self.gate_up).chunk(2, -1)
        return h + top.linear(F.silu(gate) * up, self.down)


@torch.library.custom_op("compiled_bound::attend", mutates_args=())
def attend(queries: torch.Tensor, mask: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """[n, heads * hd] queries, [n, 1, 1, width] additive mask, [2, kv_heads, slots, hd]
    K/V pool -> [n, heads * hd]: SDPA over the pool's rows in place, queries of the heads
    that share a K/V head stacked (the engine's decode attention)."""
    n, width = queries.shape[0], mask.shape[-1]
    kv_heads, hd = pool.shape[1], pool.shape[3]

    def rows(p):
        return p.as_strided((n, kv_heads, width, hd), (POOL_ROWS * hd, p.stride(0), hd, 1))

    folded = queries.view(n, kv_heads, -1, hd)
    out = F.scaled_dot_product_attention(folded, rows(pool[0]), rows(pool[1]), attn_mask=mask)
    return out.reshape(n, -1)


@attend.register_fake
def _(queries, mask, pool):
    return torch.empty_like(queries)


def loop_inputs(config, batch: int, context: int):
    hd = config.hidden_size // config.num_attention_heads
    ids = torch.randint(0, config.vocab_size, (batch,))
    cos, sin = torch.randn(batch, hd), torch.randn(batch, hd)
    mask = torch.zeros(batch, 1, 1, context)
    for i in range(batch):  # lengths spread over the second half of the context
        mask[i, ..., context // 2 + (i * context) // (2 * batch) + 1 :] = float("-inf")
    slots = batch * POOL_ROWS
    pools = [
        torch.randn(2, config.num_key_value_heads, slots, hd)
        for _ in range(config.num_hidden_layers)
    ]
    return ids, cos, sin, mask, pools


def time_loop(fn, inputs, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn(*inputs)
    return (time.perf_counter() - start) * 1000 / steps


def time_engine(engine, args, vocab: int, round_: int) -> float:
    """ms per decode step of `args.batch` fresh requests, after their prefill."""
    from symbiont.decoding import SamplingParams
    from symbiont.serve.sequence import Request

    gen = torch.Generator().manual_seed(round_)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 4, ignore_eos=True)
    requests = [
        Request(f"r{round_}-{i}", torch.randint(10, vocab, (args.prompt_len,), generator=gen).tolist(), None, params)
        for i in range(args.batch)
    ]  # fmt: skip
    for request in requests:
        engine.add_request(request)
    while any(s.num_computed < s.prompt_len for r in requests for s in r.sequences):
        engine.step()
    engine.step()  # the first decode step
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    elapsed = (time.perf_counter() - start) * 1000 / args.steps
    while not all(r.finished for r in requests):
        engine.step()
    return elapsed


def resolve(name: str, out: Path) -> str:
    if name in ("small", "100m", "500m"):
        from vllm_cpu import sized_checkpoint

        return str(sized_checkpoint(out / f"llama-{name}", name, seed=0))
    return name


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="100m", help="small, 100m, 500m or a Llama folder")
    parser.add_argument("--batch", type=int, default=16, help="sequences decoding at once")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the three arms")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "peers" / "results")
    args = parser.parse_args(argv)
    if args.prompt_len + args.steps + 6 > POOL_ROWS:
        parser.error(f"--prompt-len + --steps must stay under {POOL_ROWS - 6} (the pool's rows)")
    torch.set_num_threads(1)
    torch.manual_seed(0)

    from transformers import AutoConfig

    from symbiont.serve import EngineConfig
    from symbiont.serve.engine import Engine
    from symbiont.tenant import open_executor

    model = resolve(args.model, args.out)
    config = AutoConfig.from_pretrained(model)
    engine = Engine.from_pretrained(
        model,
        config=EngineConfig(max_running=args.batch, max_batched_tokens=512, max_queue=args.batch),
        executor=open_executor(model, prepack=True),
    )
    context = args.prompt_len + args.steps // 2 + 2
    inputs = loop_inputs(config, args.batch, context)
    eager = Decoder(config, context, packed=True).eval()
    arms = {"engine": [], "eager loop": [], "compiled loop": []}
    with torch.no_grad():
        compiled, skip = compile_loop(config, context, inputs)
        for round_ in range(args.rounds):
            arms["engine"].append(time_engine(engine, args, config.vocab_size, round_))
            arms["eager loop"].append(time_loop(eager, inputs, args.steps))
            if compiled is not None:
                arms["compiled loop"].append(time_loop(compiled, inputs, args.steps))
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    best = {name: min(times) for name, times in arms.items() if times}
    print(
        f"\nmodel {model}: {args.batch} sequences decoding, contexts about {context}, "
        f"one thread, best of {args.rounds} rounds of {args.steps} steps\n"
    )
    print("| arm | ms/step |\n|---|---:|")
    for name, ms in best.items():
        print(f"| {name} | {ms:.2f} |")
    if skip:
        print(f"| compiled loop | SKIP: {skip} |")
    print(f"\neager loop / engine: {best['eager loop'] / best['engine']:.2f}x")
    if "compiled loop" in best:
        print(f"compiled loop / eager loop: {best['compiled loop'] / best['eager loop']:.2f}x")
        print(f"compiled loop / engine: {best['compiled loop'] / best['engine']:.2f}x")
    return 0


def compile_loop(config, context: int, inputs):
    """(the compiled decoder, None), or (None, why not)."""
    import torch._inductor.config as inductor

    inductor.freezing = True  # weights become constants: inductor packs them for oneDNN
    module = Decoder(config, context, packed=False).eval()
    try:
        compiled = torch.compile(module, dynamic=True)
        start = time.perf_counter()
        compiled(*inputs)
        print(f"compiled in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    except Exception as err:  # noqa: BLE001 - any failure to compile skips the arm
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    return compiled, None


if __name__ == "__main__":
    sys.exit(main())
