#!/bin/bash
. "$(git rev-parse --show-toplevel)/.venv/bin/activate"
# the embedded SFT set (the data the runs of the log used)
DATA=$(python -c 'from symbiont.model.default import default_dataset; print(default_dataset())')
cd "$(mktemp -d)"
run() {
  local name=$1; shift
  rm -f sb.ready; symbiont serve-base --model default --bind tcp://127.0.0.1:7191 --ready-file sb.ready "$@" > sb-$name.log 2>&1 &
  local pid=$!
  for i in $(seq 300); do [ -f sb.ready ] && break; sleep 0.2; done
  rm -rf out-$name
  symbiont finetune --executor tcp://127.0.0.1:7191 --model default --method ia3 --lr 3e-1 --data "$DATA" --out out-$name --max-steps 25 --batch-size 4 --no-progress > ft-$name.log 2>&1
  kill $pid; wait $pid 2>/dev/null
  echo "$name: $(grep -o '[0-9.]* tokens/s' ft-$name.log | tail -1) | $(grep -o 'products.*fingerprint' sb-$name.log)"
}
run default
run onednn-w2 --matmul onednn --workers 2
run threads2 --threads 2
