#!/bin/bash
# For the next session lent a GPU machine (prepared, not yet run): the questions the
# first runs left open, in one budgeted script (~5 minutes of the device's time).
#   1. bf16 on AMX at batch 32 ran 0.72x of fp32 (run1-engine.log): the step profile at
#      batches 1-256 for both dtypes, at 16 and at 2 threads;
#   2. the same in oneDNN alone: a bf16 and an fp32 linear of SmolLM2's shapes at M = 8-256
#      rows (is it oneDNN's small-M bf16 path, or ours?);
#   3. whether linking libstdc++ statically stops C++ errors segfaulting (throw_probe.py).
# Run from the repository root with .whl/ and .devmodel/ carried (see run.sh):
#   OUT=DIR bash loadtest/results/device-h200-1204/next.sh
set -u
OUT=${OUT:-/tmp/device-out}; PY=${PY:-python3}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PDSERVE_TEST_CACHE_DIR=$HOME/.cache/pdserve
. loadtest/results/device-h200-1204/wheels.sh
MODEL=/tmp/smollm2-shaped
timeout 60 $PY loadtest/results/device-h200-1204/make_model.py .devmodel $MODEL > "$OUT/model.log" 2>&1
for t in ${THREADS_LIST:-$(nproc) 2}; do
    timeout 150 $PY -c "import sys; from cluster.cli import main; sys.exit(main())" \
        bench-engine --model $MODEL --profile-only --dtype float32 --dtype bfloat16 \
        --threads "$t" --profile-batches "${BATCHES:-1,8,16,32,64,128,256}" \
        --out "/tmp/profile-$t.json" > "$OUT/profile-$t.log" 2>&1
    echo "profile at $t threads: rc $?" >> "$OUT/steps.txt"
done
timeout 60 $PY - > "$OUT/onednn.log" 2>&1 <<'PYEOF'
import time, torch
torch.manual_seed(0)
for threads in sorted({torch.get_num_threads(), 2}, reverse=True):
    torch.set_num_threads(threads)
    print(f"threads {threads}, cpu capability {torch.backends.cpu.get_cpu_capability()}")
    for k, n in ((576, 1536), (1536, 576), (576, 960)):
        for m in (8, 16, 32, 64, 256):
            row = []
            for dt in (torch.float32, torch.bfloat16):
                x, w = torch.randn(m, k, dtype=dt), torch.randn(n, k, dtype=dt)
                for _ in range(5): torch.nn.functional.linear(x, w)
                t = time.perf_counter(); reps = 200
                for _ in range(reps): torch.nn.functional.linear(x, w)
                row.append((time.perf_counter() - t) / reps * 1e6)
            print(f"  K {k:5} N {n:5} M {m:4}: fp32 {row[0]:8.1f} us  bf16 {row[1]:8.1f} us  "
                  f"bf16/fp32 {row[1] / row[0]:.2f}")
PYEOF
echo "onednn: rc $?" >> "$OUT/steps.txt"
timeout 200 $PY loadtest/results/device-h200-1204/throw_probe.py "$PDSERVE_TEST_CACHE_DIR/kernels" \
    > "$OUT/probe.txt" 2>&1; echo "probe: rc $?" >> "$OUT/steps.txt"
cat "$OUT/steps.txt"; grep -A9 "^batch" "$OUT"/profile-*.log; cat "$OUT/onednn.log"
grep -v "^  " "$OUT/probe.txt"
