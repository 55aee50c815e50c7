#!/usr/bin/env bash
# The checks and measurements that need a CUDA GPU, as one run (CI has no GPU; a lent
# GPU machine runs this). Each step is bounded and runs whatever the previous one did;
# logs go to $OUT (default: ./gpu-out).
#
#   bash benchmarks/gpu_checks.sh                 # all steps
#   STEPS="tests transport" bash benchmarks/gpu_checks.sh
#   MPS=1 STEPS="switch transport" TRANSPORT_ARGS="--tokens 1,64 --calls 500" bash ...
#
# Packages the machine lacks can come as wheels in .whl/ (ignored by git): they are
# installed into /tmp/site first. Steps:
#   tests      tests/test_gpu.py: every placement on the GPU against vanilla
#   transport  benchmarks/transport_overhead.py --device cuda: CUDA IPC vs host areas
#   roofline   benchmarks/gpu_roofline.py: base layers' time vs their memory roofline
#   memory     benchmarks/multi_finetune.py --device cuda: N jobs' GPU memory, split vs not
#   memory-wait  the split arm again with SYMBIONT_GPU_EVENTS=0 (GPU areas ordered by
#              waiting on both sides, not by an event), for comparison with memory's
#   switch     benchmarks/gpu_process_switch.py: two processes taking turns on the GPU
#
# MPS=1 runs the steps under NVIDIA MPS (a control daemon started here and stopped at
# the end), so that every process's kernels share one GPU context; logs get "-mps".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
STEPS=${STEPS:-tests transport roofline memory switch}
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    # installed once per set of wheels (a warm machine reruns this script)
    wheels=$(ls .whl/*.whl)
    if [[ "$(cat /tmp/site/.installed 2>/dev/null)" != "$wheels" ]]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || exit 1
        echo "$wheels" > /tmp/site/.installed
    fi
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
"$PY" -c "import torch, transformers, peft; print('torch', torch.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__, '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO CUDA')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

SUFFIX=
if [[ ${MPS:-0} == 1 ]]; then
    MPS_CONTROL=$(command -v nvidia-cuda-mps-control || ls /usr/local/nvidia/bin/nvidia-cuda-mps-control 2>/dev/null)
    [[ -n $MPS_CONTROL ]] || { echo "MPS=1: no nvidia-cuda-mps-control on this machine"; exit 1; }
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    echo quit | "$MPS_CONTROL" >/dev/null 2>&1  # a daemon a killed run left behind
    "$MPS_CONTROL" -d || { echo "MPS=1: $MPS_CONTROL -d failed"; exit 1; }
    trap 'echo quit | "$MPS_CONTROL"; cat "$CUDA_MPS_LOG_DIRECTORY"/*.log > "$OUT/mps-daemon.log" 2>&1' EXIT
    echo "MPS: control daemon started ($MPS_CONTROL)"
    SUFFIX=-mps
fi

step() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    [[ " $STEPS " == *" $name "* ]] || return 0
    echo "=== $name ($(date +%T), at most ${limit}s)"
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name$SUFFIX.log" 2>&1
    local rc=$?
    tail -n 40 "$OUT/$name$SUFFIX.log"
    echo "=== $name: exit $rc after $((SECONDS - start))s"
}

step switch 60 "$PY" benchmarks/gpu_process_switch.py --exchanges ${EXCHANGES:-5000}
step tests 180 "$PY" -m pytest -q -x -rs tests/test_gpu.py ${TESTS_K:+-k "$TESTS_K"}
step transport 90 "$PY" benchmarks/transport_overhead.py --device cuda --hidden 4096 \
    ${TRANSPORT_ARGS:---tokens 1,64,512 --calls 1000}
step roofline 120 "$PY" benchmarks/gpu_roofline.py --out "$OUT/roofline.json"
MEMORY_ARGS=(--device cuda --model 443m --jobs 1,4 --steps ${MEMORY_STEPS:-3} --work /tmp/multi-finetune)
step memory 180 "$PY" benchmarks/multi_finetune.py "${MEMORY_ARGS[@]}" --arms vanilla,symbiont
step memory-wait 150 env SYMBIONT_GPU_EVENTS=0 "$PY" benchmarks/multi_finetune.py \
    "${MEMORY_ARGS[@]}" --arms symbiont
