#!/bin/bash
# Does OpenMP's idle policy hold a 16-thread decode step back? Run 6 found the batch-1
# step's non-GEMM parts and its GEMV calls far slower per call at 16 threads than on a
# 2-core VM. The same step profile (fp32 and bf16, batches 1, 8, 32) under three
# environments, each a fresh process (libgomp reads them when it loads): as is; threads
# spinning between parallel regions (OMP_WAIT_POLICY=ACTIVE, GOMP_SPINCOUNT=infinite);
# that plus threads pinned to cores (OMP_PROC_BIND=close, OMP_PLACES=cores). ~3 device
# minutes with the start.
#   OUT=DIR bash loadtest/results/device-h200-1204/omp.sh   (.whl/, .devmodel/ carried)
. loadtest/results/device-h200-1204/prelude.sh
prof() { local name=$1; shift; local s=$(date +%s)
    env "$@" timeout 80 $PY -c "import sys; from cluster.cli import main; sys.exit(main())" \
        bench-engine --model $MODEL --profile-only --dtype float32 --dtype bfloat16 \
        --threads $N --profile-batches ${BATCHES:-1,8,32} --out /tmp/$name.json \
        > "$OUT/omp-$name.log" 2>&1
    echo "$name: rc $? in $(( $(date +%s) - s ))s" >> "$OUT/steps.txt"; }
prof default
prof active OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=infinite
prof bound OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=infinite OMP_PROC_BIND=close OMP_PLACES=cores
cat "$OUT/steps.txt"
for f in "$OUT"/omp-*.log; do echo "== $f"; grep -h -A4 "^batch" "$f" | cut -c1-200; done
