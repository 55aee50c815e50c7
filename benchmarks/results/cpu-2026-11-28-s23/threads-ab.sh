#!/bin/bash
# serve-base variants x lone finetune client on the default model
. "$(git rev-parse --show-toplevel)/.venv/bin/activate"
# the embedded SFT set (the data the runs of the log used)
DATA=$(python -c 'from symbiont.model.default import default_dataset; print(default_dataset())')
cd "$(mktemp -d)"
run() {  # name, env, flags
  local name=$1; shift; local envs=$1; shift
  rm -f sb.ready; env $envs symbiont serve-base --model default --bind tcp://127.0.0.1:7191 --ready-file sb.ready "$@" > sb-$name.log 2>&1 &
  local pid=$!
  for i in $(seq 100); do [ -f sb.ready ] && break; sleep 0.2; done
  rm -rf out-$name
  local t=$( { /usr/bin/time -f %e symbiont finetune --executor tcp://127.0.0.1:7191 --model default --method ia3 --lr 3e-1 --data "$DATA" --out out-$name --max-steps 25 --batch-size 4 --no-progress > ft-$name.log 2>&1; } 2>&1 )
  kill $pid; wait $pid 2>/dev/null
  echo "$name: $(grep -o '[0-9.]* tokens/s' ft-$name.log | tail -1) wall $t"
}
for r in 1 2; do
run default ""
run passive "OMP_WAIT_POLICY=PASSIVE"
run threads1 ""  --threads 1
done
