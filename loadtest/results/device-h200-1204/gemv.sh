#!/bin/bash
# Checks the decode GEMV's two changes of 2026-12-04 (evening) on the lent GPU machine's
# CPU (16-vCPU Sapphire Rapids, AMX): the GEMV now runs bf16 models too, and its weight
# layout (row-major or tiles) is timed at load instead of set by the ISA. In one call:
# the step profile at 16 threads in both dtypes (it prints the layout chosen and the
# timings), the two layouts alternated in single-stream decode (benchmarks.gemv_layout),
# workload (a) with single stream and TTFT in both dtypes, and int8 vs each dtype single
# stream (~6.5 device minutes with the start).
#   OUT=DIR bash loadtest/results/device-h200-1204/gemv.sh   (.whl/, .devmodel/ carried)
# Dry run here: NO_WHL=1 QUICK=1 PY=.venv/bin/python bash ...gemv.sh
. loadtest/results/device-h200-1204/prelude.sh
run() { local cap=$1 log=$2; shift 2; local s=$(date +%s)
    timeout "$cap" "$@" > "$OUT/$log" 2>&1
    echo "$log: rc $? in $(( $(date +%s) - s ))s (cap $cap)" >> "$OUT/steps.txt"; }
bench() { local cap=$1 log=$2; shift 2
    run "$cap" "$log" $PY -c "import sys; from cluster.cli import main; sys.exit(main())" \
        bench-engine --model $MODEL "$@"; }
bench 130 profile-$N.log --profile-only --dtype float32 --dtype bfloat16 --threads $N \
    --profile-batches ${BATCHES:-1,8,32} --out /tmp/p1.json
for d in float32 bfloat16; do
    run 50 layout-$d-$N.log $PY -m benchmarks.gemv_layout --model $MODEL --dtype $d \
        --threads $N --runs ${RUNS:-3}
done
bench 150 engine-a-$N.log --workload a --skip-hf --dtype float32 --dtype bfloat16 \
    --threads $N --out /tmp/a.json ${QUICK:+--quick}
bench 70 int8-$N.log --quantization int8 --dtype float32 --dtype bfloat16 \
    --compare-threads $N ${QUICK:+--quick}
cat "$OUT/steps.txt"; grep -h "GEMV layout\|GEMMs chosen" "$OUT"/profile-*.log
grep -h -A4 "^batch" "$OUT"/profile-*.log; tail -n 6 "$OUT"/layout-*.log
grep -h -B2 -A14 "tok/s" "$OUT/engine-a-$N.log" | head -70; tail -n 12 "$OUT/int8-$N.log"
