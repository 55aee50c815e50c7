"""Where a process's memory is: its PSS grouped by mapping (a file, [heap], [anon], ...).

    python benchmarks/pss_by_mapping.py --match "serve-base|multi_finetune.py worker" --every 8 --times 12

Reads /proc/PID/smaps of every process whose command line matches `--match` (a regular
expression, as `pgrep -f` takes it), `--times` times, `--every` seconds apart, and prints
each process's total PSS and its largest mappings. PSS divides a shared page among the
processes that map it, so a checkpoint that several jobs memory-map counts once in their
sum. Run it beside a benchmark (e.g. `multi_finetune.py`) to see what a client, a
vanilla job and the executor hold.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time

_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$")


def matching_pids(pattern: str) -> list[int]:
    wanted = re.compile(pattern)
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if wanted.search(command):
            pids.append(int(entry))
    return pids


def pss_by_mapping(pid: int) -> collections.Counter:
    """mapping name -> PSS in KiB (site-packages paths shortened)."""
    groups: collections.Counter = collections.Counter()
    name = "[anon]"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            mapping = _MAPPING.match(line)
            if mapping:
                name = re.sub(r"^.*/site-packages/", "", mapping.group(1) or "[anon]")
            elif line.startswith("Pss:"):
                groups[name] += int(line.split()[1])
    return groups


def report(pid: int, top: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        command = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
    groups = pss_by_mapping(pid)
    lines = [f"pid {pid}: {command}", f"  total PSS {sum(groups.values()) / 1024:.1f} MiB"]
    lines += [f"  {kib / 1024:8.1f} MiB  {name[:90]}" for name, kib in groups.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--match", required=True, help="regular expression on command lines")
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--times", type=int, default=1, help="how many samples")
    parser.add_argument("--top", type=int, default=8, help="mappings shown per process")
    args = parser.parse_args(argv)
    for sample in range(args.times):
        if sample:
            time.sleep(args.every)
        pids = matching_pids(args.match)
        print(f"--- sample {sample + 1}/{args.times}: {len(pids)} matching processes", flush=True)
        for pid in pids:
            try:
                print(report(pid, args.top), flush=True)
            except OSError:  # it exited meanwhile
                continue
    return 0


if __name__ == "__main__":
    sys.exit(main())
