#!/usr/bin/env bash
# Run on the H200 after `source .gpu/bin/env.sh` (see ../shared/gpu/README.md).
#   bash tools/gpu_session.sh tests|demo|toy|bench ...
# Logs and JSON land in $OUT (or ./gpu-out).
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export DSA_PRECISION_REPORT=$OUT/gpu_report.jsonl
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/device.txt"
for step in "$@"; do
  start=$(date +%s)
  case $step in
    tests) timeout 480 python -m pytest -m gpu -q -rs --durations=15 tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
    demo) timeout 240 python -m dsa_precision demo --device cuda 2>&1 | tee "$OUT/demo_cuda.txt" | tail -20
          timeout 240 python -m dsa_precision demo --device cuda --json > "$OUT/demo_cuda.json" 2>"$OUT/demo_cuda.err" ;;
    toy) timeout 540 python examples/toy_glm5_train.py --out "$OUT/toy.json" 2>&1 | grep -v -i "warn\|deprecated" | tee "$OUT/toy.log" | tail -20 ;;
    tune) timeout 300 python tools/tune_prepare.py --out "$OUT/tune.json" 2>&1 | tee "$OUT/tune.txt" ;;
    bench) # with the launch shape tune chose, if it ran
           timeout 540 python - "$OUT/tune.json" ${BENCH_ARGS:-} > "$OUT/bench${BENCH_TAG:-}.json" 2> "$OUT/bench${BENCH_TAG:-}.err" <<'PY'
import json, os, sys
import dsa_precision.kernels.preprocess_quantize as kernel
from dsa_precision.cli import main
if os.path.exists(sys.argv[1]):
    kernel.BLOCK_ROWS, kernel.NUM_WARPS = json.load(open(sys.argv[1]))["best"]
print(f"launch shape {kernel.BLOCK_ROWS}x{kernel.NUM_WARPS}", file=sys.stderr)
sys.exit(main(["bench", "--json", *sys.argv[2:]]))
PY
           python - "$OUT/bench${BENCH_TAG:-}.json" <<'PY' | tee "$OUT/bench${BENCH_TAG:-}.txt"
import json, sys
from dsa_precision.bench import format_tables
print(format_tables(json.load(open(sys.argv[1]))))
PY
           ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  echo "[$step] $(( $(date +%s) - start )) s"
done
