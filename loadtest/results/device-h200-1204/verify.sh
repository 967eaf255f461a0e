#!/bin/bash
# Checks the measured GEMM choice (workers.models.linear.tuned_linear) on the lent GPU
# machine's CPU, where next.sh found oneDNN's reordered bf16 GEMMs 2.3-6x slower than
# F.linear at 8-128 rows with 16 threads (reorder.log): the step profile at 16 threads in
# both dtypes, workload (a) in both, the bf16 profile at 2 threads (~4.5 device minutes).
#   OUT=DIR bash loadtest/results/device-h200-1204/verify.sh   (.whl/, .devmodel/ carried)
. loadtest/results/device-h200-1204/prelude.sh
bench() { timeout "$1" $PY -c "import sys; from cluster.cli import main; sys.exit(main())" \
    bench-engine --model $MODEL "${@:3}" > "$OUT/$2" 2>&1; echo "$2: rc $?" >> "$OUT/steps.txt"; }
D=${DTYPES:-float32 bfloat16}; DT=$(for d in $D; do printf -- "--dtype %s " $d; done)
bench 100 profile-$N.log --profile-only $DT --threads $N \
    --profile-batches ${BATCHES:-1,8,32,64,256} --out /tmp/p1.json
bench 130 engine-a-$N.log --workload a --skip-hf $DT \
    --threads $N --out /tmp/a.json ${QUICK:+--quick}
[ -n "${SKIP2:-}" ] || bench 60 profile-2.log --profile-only --dtype bfloat16 --threads 2 \
    --profile-batches ${BATCHES:-1,32,256} --out /tmp/p2.json
cat "$OUT/steps.txt"; grep -h "GEMMs" "$OUT"/profile-*.log
grep -h -A6 "^batch" "$OUT"/profile-*.log; grep -h -B2 -A12 "tok/s" "$OUT/engine-a-$N.log" | head -60
