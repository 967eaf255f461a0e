cd /work/wt
export PDS_PLACE_LOG=/tmp/d1/place.jsonl
PYTHONPATH=/work/wt /work/main/.venv/bin/python -m cluster.cli plan --validate --no-recalibrate \
  --profile /work/main/loadtest/results/plan-validate-avx2/1P-x1t---1D-x1t--adaptive--static-32-profile.json \
  --cores 2 --workload mixed --num-requests 60 --request-rate 0.4 --input-len 128 --output-len 96 \
  --range-ratio 0.2 --long-fraction 0.25 --long-input-len 1024 --long-output-len 16 \
  --slo-ttft-ms 10000 --slo-tpot-ms 250 --thresholds 0,256,1024 \
  --configs "1P x1t + 1D x1t, adaptive (static 32)" --out /tmp/d1/out
