"""Cost of masked activations: step time and bytes on the wire, masked / unmasked.

One LoRA fine-tuning step (forward + backward) and one greedy generate per mode, rounds
interleaved so machine noise hits every mode alike; prints the median time ratio of
each mode against unmasked (targets: pool <= 1.1x, shares <= 2.2x) and the ratio of
bytes sent to and received from executors. `--remote` runs the executors as serve-base
processes (two for shares) over loopback TCP instead of in this process. Usage:

    python benchmarks/masking.py [--hidden 512 --layers 4 --tokens 512 --rounds 5 --remote]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time

import peft
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import symbiont
from symbiont.processes import ServerProcess
from symbiont.protocol.executor import Executor, Op

MODES = ("unmasked", "pool", "shares")


class Counting(Executor):
    """Counts the bytes a call sends and receives (what a transport carries)."""

    def __init__(self, inner: Executor):
        self.inner = inner
        self.sent = self.received = 0

    @property
    def manifest(self):
        return self.inner.manifest

    def call(self, op: Op, layer: int, x: torch.Tensor) -> torch.Tensor:
        y = self.inner.call(op, layer, x)
        self.sent += x.nbytes
        self.received += y.nbytes
        return y

    def close(self) -> None:
        self.inner.close()


def build_checkpoint(folder: str, hidden: int, layers: int, vocab: int) -> None:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def open_executors(path, mode: str, servers, transport: str) -> tuple[Counting, ...]:
    count = 2 if mode == "shares" else 1
    if servers:
        return tuple(
            Counting(symbiont.connect(s.url("tcp"), checkpoint=path, mode=transport))
            for s in servers[:count]
        )
    return tuple(Counting(symbiont.BaseExecutor.from_pretrained(path)) for _ in range(count))


def client(path, executors, mode: str):
    mask = None if mode == "unmasked" else mode
    pair = executors if mode == "shares" else executors[0]
    model = symbiont.load_client(path, pair, mask_activations=mask)
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=16, target_modules="all-linear"))


def train_step(model, ids) -> None:
    model(input_ids=ids, labels=ids).loss.backward()


def generate(model, prompt, new_tokens: int) -> None:
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)  # fmt: skip


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per training step")
    parser.add_argument("--new-tokens", type=int, default=16, help="generated per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--remote", action="store_true", help="executors as serve-base (TCP)")
    parser.add_argument(
        "--transport",
        choices=("shm", "zmq"),
        default="shm",
        help="with --remote: shared memory (same host) or ZeroMQ frames, as to another host",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = tempfile.mkdtemp(prefix="symbiont-masking-")
    build_checkpoint(folder, args.hidden, args.layers, args.vocab)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.tokens // 256 or 1, 256), generator=generator)
    prompt = torch.randint(0, args.vocab, (1, 16), generator=generator)

    with contextlib.ExitStack() as stack:
        servers = []
        if args.remote:
            argv = ("--threads", str(args.threads or 1))
            for _ in range(2):
                server = ServerProcess(folder, bind=("tcp://127.0.0.1:*",), args=argv)
                servers.append(stack.enter_context(server.start()))
        executors = {m: open_executors(folder, m, servers, args.transport) for m in MODES}
        models = {m: client(folder, executors[m], m) for m in MODES}
        times = {m: {"train": [], "generate": []} for m in MODES}
        bytes_per_step = {}
        for mode in MODES:  # warm up, and count one step's bytes
            for e in executors[mode]:
                e.sent = e.received = 0
            train_step(models[mode], ids)
            bytes_per_step[mode] = sum(e.sent + e.received for e in executors[mode])
            generate(models[mode], prompt, 2)
        for _ in range(args.rounds):
            for mode in MODES:
                times[mode]["train"].append(timed(lambda m=mode: train_step(models[m], ids)))
                times[mode]["generate"].append(
                    timed(lambda m=mode: generate(models[m], prompt, args.new_tokens))
                )
        for pair in executors.values():
            for executor in pair:
                executor.close()

    placement = f"serve-base ({args.transport})" if args.remote else "in process"
    print(
        f"Llama hidden {args.hidden}, {args.layers} layers, LoRA r=16 all-linear; executors "
        f"{placement}; {ids.numel()} tokens per train step, {args.new_tokens} generated; "
        f"median of {args.rounds} rounds, threads {torch.get_num_threads()}"
    )
    print(f"{'mode':<10}{'train s':>9}{'ratio':>7}{'generate s':>12}{'ratio':>7}{'bytes/step':>13}{'ratio':>7}")  # fmt: skip
    base = {k: statistics.median(v) for k, v in times["unmasked"].items()}
    for mode in MODES:
        train = statistics.median(times[mode]["train"])
        gen = statistics.median(times[mode]["generate"])
        wire = bytes_per_step[mode]
        print(
            f"{mode:<10}{train:>9.3f}{train / base['train']:>7.2f}{gen:>12.3f}"
            f"{gen / base['generate']:>7.2f}{wire:>13,}{wire / bytes_per_step['unmasked']:>7.2f}"
        )


if __name__ == "__main__":
    main()
