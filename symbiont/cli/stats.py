"""`symbiont stats URL`: live statistics of a running `serve-base`."""

from __future__ import annotations

import json
import os

HELP = "print live statistics of a running serve-base (clients, per-layer batching, tokens/s)"


def register(subparsers) -> None:
    parser = subparsers.add_parser("stats", help=HELP, description=HELP)
    parser.add_argument("url", help="the executor's URL, e.g. tcp://127.0.0.1:7100")
    parser.add_argument("--token", default=os.environ.get("SYMBIONT_TOKEN"))
    parser.add_argument("--json", action="store_true", help="print the raw JSON")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer")
    parser.set_defaults(func=run)


def run(args) -> int:
    from symbiont.transport import connect

    with connect(
        args.url, token=args.token, mode="zmq", label="stats", connect_timeout_s=args.timeout
    ) as executor:
        stats = executor.stats()
    print(json.dumps(stats, indent=2) if args.json else render(stats))
    return 0


def render(stats: dict) -> str:
    total = stats["total"]
    lines = [
        f"uptime {stats['uptime_s']:.0f} s, policy {stats['policy']['kind']}, "
        f"{stats['tokens_per_s']:.1f} tokens/s (last 10 s), "
        f"{stats['refused']} refused, {stats['errors']} errors",
        f"all layers: {total['batches']} batches, mean batch {total['mean_batch_calls']:.2f} "
        f"calls / {total['mean_batch_tokens']:.1f} tokens, "
        f"mean queue wait {total['mean_queue_wait_ms']:.3f} ms",
        f"clients ({len(stats['clients'])}):",
    ]
    for c in stats["clients"]:
        lines.append(
            f"  {c['label']:<24} {c['transport']:<4} pid {c['pid']:<7} on {c['host']}: "
            f"{c['calls']} calls, {c['tokens']} tokens"
        )
    lines.append(f"{'layer':<40} {'batches':>8} {'calls/b':>8} {'tok/b':>8} {'wait ms':>8}")
    for name, e in stats["layers"].items():
        lines.append(
            f"{name:<40} {e['batches']:>8} {e['mean_batch_calls']:>8.2f} "
            f"{e['mean_batch_tokens']:>8.1f} {e['mean_queue_wait_ms']:>8.3f}"
        )
    return "\n".join(lines)
