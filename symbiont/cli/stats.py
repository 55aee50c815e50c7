"""`symbiont stats URL`: live statistics of a running `serve-base`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from symbiont.cli.flags import add_flags, from_args

HELP = "print live statistics of a running serve-base (clients, per-layer batching, rows/s)"


@dataclass(frozen=True)
class StatsQuery:
    """What `symbiont stats` asks and how long it waits (each field is a flag)."""

    token: str | None = field(
        default=None,
        metadata={"help": "the executor's shared secret", "env": "SYMBIONT_TOKEN"},
    )
    json: bool = field(default=False, metadata={"help": "print the raw JSON"})
    timeout: float = field(default=5.0, metadata={"help": "seconds to wait for an answer"})

    def __post_init__(self) -> None:
        if not 0 < self.timeout <= 3600:  # also false for NaN
            raise ValueError(f"--timeout must be in (0, 3600] seconds, got {self.timeout}")


def register(subparsers) -> None:
    parser = subparsers.add_parser("stats", help=HELP, description=HELP)
    parser.add_argument("url", help="the executor's URL, e.g. tcp://127.0.0.1:7100")
    add_flags(parser, StatsQuery)
    parser.set_defaults(func=run)


def run(args) -> int:
    from symbiont.client.remote import stats_of

    query = from_args(StatsQuery, args)
    stats = stats_of(args.url, token=query.token, timeout_s=query.timeout)
    print(json.dumps(stats, indent=2) if query.json else render(stats))
    return 0


def _split_note(split: int) -> str:
    return f", {split} split over the workers (one client)" if split else ""


def render(stats: dict) -> str:
    total = stats["total"]
    lines = [
        f"uptime {stats['uptime_s']:.0f} s, policy {stats['policy']['kind']}, "
        # summed over layer calls: a model pass counts each of its tokens once per layer
        f"{stats['tokens_per_s']:.1f} layer-token rows/s (last 10 s), "
        f"{stats['refused']} refused, {stats['errors']} errors",
        f"all layers: {total['batches']} batches, mean batch {total['mean_batch_calls']:.2f} "
        f"calls / {total['mean_batch_tokens']:.1f} tokens, "
        f"mean queue wait {total['mean_queue_wait_ms']:.3f} ms"
        + _split_note(stats.get("split_batches", 0)),
        f"clients ({len(stats['clients'])}):",
    ]
    for c in stats["clients"]:
        lines.append(
            f"  {c['label']:<24} {c['transport']:<4} pid {c['pid']:<7} on {c['host']}: "
            f"{c['calls']} calls, {c['tokens']} layer-token rows"
        )
    lines.append(f"{'layer':<40} {'batches':>8} {'calls/b':>8} {'tok/b':>8} {'wait ms':>8}")
    for name, e in stats["layers"].items():
        lines.append(
            f"{name:<40} {e['batches']:>8} {e['mean_batch_calls']:>8.2f} "
            f"{e['mean_batch_tokens']:>8.1f} {e['mean_queue_wait_ms']:>8.3f}"
        )
    return "\n".join(lines)
