#!/bin/bash
# Second device run: why the kernel tests segfaulted on the Sapphire Rapids host (run.sh's
# kernels.log: test_rejects_bad_inputs[avx512], the first test whose op raises).
#   OUT=DIR bash loadtest/results/device-h200-1204/diag.sh
set -u
OUT=${OUT:-/tmp/device-out}; PY=${PY:-python3}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PDSERVE_TEST_CACHE_DIR=$HOME/.cache/pdserve
. loadtest/results/device-h200-1204/wheels.sh
{ g++ --version; $PY -c "import torch; print(torch.__config__.show())"; } > "$OUT/toolchain.txt" 2>&1
timeout 200 $PY loadtest/results/device-h200-1204/throw_probe.py "$PDSERVE_TEST_CACHE_DIR/kernels" \
    > "$OUT/probe.txt" 2>&1; echo "probe rc $?" >> "$OUT/probe.txt"
for so in "$PDSERVE_TEST_CACHE_DIR"/kernels/*/*.so; do echo "== $so"; ldd "$so"; done >> "$OUT/probe.txt" 2>&1
$PY -c "import torch, os; print([l.split()[-1] for l in open('/proc/self/maps') if 'gomp' in l or 'stdc++' in l or 'gcc_s' in l])" >> "$OUT/probe.txt" 2>&1
timeout 150 $PY -m pytest -n 8 --max-worker-restart 80 -q -rs -p no:cacheprovider \
    tests/unit/test_paged_decode_kernel.py tests/unit/test_fused_kernels.py \
    tests/unit/test_int8_linear.py tests/unit/test_kernel_kv_encode.py \
    tests/unit/test_kernel_kv_quant.py tests/unit/test_kv_format.py tests/unit/test_dtype_choice.py \
    > "$OUT/kernels-xdist.log" 2>&1; echo "pytest rc $?" >> "$OUT/kernels-xdist.log"
cat "$OUT/probe.txt"; grep -E "crashed|FAILED|passed|failed|rc " "$OUT/kernels-xdist.log" | tail -40
