#!/bin/bash
# The checks a lent GPU machine can do that this project's CPU VMs cannot, in one run
# (the device tool gives a session 15 minutes of such a machine, its start included):
#   1. the GPU checks (tests/integration/test_gpu_checks.py): the engine on CUDA against
#      Hugging Face, KV from CUDA tensors through the channel, a CUDA prefill/decode pair,
#      fp8 KV on the GPU against the CPU engine;
#   2. the native kernels' unit tests on this CPU (AVX-512 paths, compiled with
#      -march=native here; only compile-checked on the AVX2 VMs);
#   3. pdserve bench-engine (float32 and bfloat16) on a SmolLM2-shaped random checkpoint
#      (make_model.py: the real weights do not fit the tool's 64 MiB);
#   4. the int8 weight comparison, single stream.
# Run from the repository root:  OUT=DIR bash loadtest/results/device-h200-1204/run.sh
# Expects .whl/ (the Python packages that machine lacks, as cp312 wheels) and .devmodel/
# (the default model's config and tokenizer files). Each step has a deadline so that the
# whole run ends inside BUDGET seconds and every log written so far comes back.
set -u
OUT=${OUT:-/tmp/device-out}
PY=${PY:-python3}
BUDGET=${BUDGET:-520}
THREADS=${THREADS:-$(nproc)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PDSERVE_TEST_CACHE_DIR=${PDSERVE_TEST_CACHE_DIR:-$HOME/.cache/pdserve}
t0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - t0) )); }
step() {  # step NAME CAP LOG CMD...: run CMD for at most min(CAP, time left), log to OUT
    local name=$1 cap=$2 log=$3; shift 3
    local t=$(left); (( t > cap )) && t=$cap
    if (( t < 15 )); then echo "== $name: skipped, $(left)s left" | tee -a "$OUT/steps.txt"; return; fi
    local s=$(date +%s)
    timeout "$t" "$@" > "$OUT/$log" 2>&1
    echo "== $name: rc $? in $(( $(date +%s) - s ))s (cap ${t}s)" | tee -a "$OUT/steps.txt"
}

{ date -u; uname -a; nproc; lscpu; nvidia-smi || true; $PY -V
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'cpu capability', torch.backends.cpu.get_cpu_capability(), \
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
  grep -m1 '^flags' /proc/cpuinfo; } > "$OUT/machine.txt" 2>&1
. loadtest/results/device-h200-1204/wheels.sh

KERNEL_TESTS="tests/unit/test_paged_decode_kernel.py tests/unit/test_fused_kernels.py
  tests/unit/test_int8_linear.py tests/unit/test_kernel_kv_encode.py
  tests/unit/test_kernel_kv_quant.py tests/unit/test_kv_format.py tests/unit/test_dtype_choice.py"
step gpu-checks 150 gpu.log $PY -m pytest -q -rs -p no:cacheprovider tests/integration/test_gpu_checks.py
# shellcheck disable=SC2086
step kernel-tests 110 kernels.log $PY -m pytest -q -rs -p no:cacheprovider $KERNEL_TESTS
MODEL=/tmp/smollm2-shaped
step make-model 60 model.log $PY loadtest/results/device-h200-1204/make_model.py .devmodel $MODEL
step bench-engine 250 engine.log $PY -c "import sys; from cluster.cli import main; sys.exit(main())" \
    bench-engine --model $MODEL --threads "$THREADS" --out "$OUT/engine.json" \
    ${QUICK:+--quick}
step bench-int8 80 int8.log $PY -c "import sys; from cluster.cli import main; sys.exit(main())" \
    bench-engine --model $MODEL --dtype float32 --quantization int8 \
    --compare-threads "1,$THREADS" --out /tmp/int8.json ${QUICK:+--quick}
echo "== total $(( $(date +%s) - t0 ))s" | tee -a "$OUT/steps.txt"
tail -n 3 "$OUT"/gpu.log "$OUT"/kernels.log
tail -n 40 "$OUT"/engine.log "$OUT"/int8.log
