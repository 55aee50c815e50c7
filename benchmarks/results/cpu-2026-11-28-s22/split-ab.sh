#!/bin/bash
# Session 22: a lone client's products split over serve-base's idle workers, against the
# previous commit (a worktree of 34d094b at /tmp/old), interleaved, two rounds; then the
# new code against vanilla jobs that use every core (--vanilla-threads share).
# Run from the repository root with its .venv active.
set -e
CMD="benchmarks/multi_finetune.py --model 100m --jobs 1,4 --steps 8 --arms vanilla,symbiont --executor-matmul onednn"
for round in 1 2; do
  echo "== round $round: before (34d094b)"
  (cd /tmp/old && PYTHONPATH=/tmp/old python $CMD --work /tmp/mf-old) | grep -v Writing
  echo "== round $round: after"
  python $CMD --work /tmp/mf-new | grep -v Writing
done
for round in 1 2; do
  echo "== vanilla on every core, round $round"
  python benchmarks/multi_finetune.py --model 100m --jobs 1 --steps 8 --arms vanilla,symbiont --executor-matmul onednn --vanilla-threads share --work /tmp/mf-new | grep -v Writing
done
