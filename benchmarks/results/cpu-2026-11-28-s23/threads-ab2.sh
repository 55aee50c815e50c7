#!/bin/bash
. "$(git rev-parse --show-toplevel)/.venv/bin/activate"
# the embedded SFT set (the data the runs of the log used)
DATA=$(python -c 'from symbiont.model.default import default_dataset; print(default_dataset())')
cd "$(mktemp -d)"
M=${M:-default}; STEPS=${STEPS:-25}
run() {  # name, env, flags
  local name=$1; shift; local envs=$1; shift
  rm -f sb.ready; env $envs symbiont serve-base --model $M --bind tcp://127.0.0.1:7191 --ready-file sb.ready "$@" > sb-$name.log 2>&1 &
  local pid=$!
  for i in $(seq 300); do [ -f sb.ready ] && break; sleep 0.2; done
  rm -rf out-$name
  symbiont finetune --executor tcp://127.0.0.1:7191 --model $M --method lora --data "$DATA" --out out-$name --max-steps $STEPS --batch-size 4 --no-progress > ft-$name.log 2>&1
  kill $pid; wait $pid 2>/dev/null
  echo "$M $name: $(grep -o '[0-9.]* tokens/s' ft-$name.log | tail -1)"
}
for r in 1 2; do
run onednn-w2 "" --matmul onednn --workers 2
run onednn-w2-passive "OMP_WAIT_POLICY=PASSIVE" --matmul onednn --workers 2
run onednn-w2-t1 "" --matmul onednn --workers 2 --threads 1
run passive "OMP_WAIT_POLICY=PASSIVE"
run threads1 "" --threads 1
done
