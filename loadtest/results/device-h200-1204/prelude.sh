# Sourced by verify.sh, gemv.sh and omp.sh: OUT and PY, the environment, the carried
# wheels (wheels.sh), and the SmolLM2-shaped random checkpoint at $MODEL (make_model.py
# from .devmodel/); N is the machine's CPU count.
set -u
OUT=${OUT:-/tmp/device-out}; PY=${PY:-python3}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PDSERVE_TEST_CACHE_DIR=$HOME/.cache/pdserve
. loadtest/results/device-h200-1204/wheels.sh
MODEL=/tmp/smollm2-shaped; N=$(nproc)
grep -m1 '^flags' /proc/cpuinfo > "$OUT/flags.txt"
timeout 60 $PY loadtest/results/device-h200-1204/make_model.py .devmodel $MODEL > "$OUT/model.log" 2>&1
