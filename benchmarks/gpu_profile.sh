#!/usr/bin/env bash
# Quick compute profile of one CUDA GPU (well under 5 minutes), then the measured bf16 GEMM curve
# against the accelerator file's peak and gemm_efficiency.
#
#   benchmarks/gpu_profile.sh [accelerator]        # accelerator: h200, h100-sxm, ... (default: guessed)
#
# Then one `shardplan train` per strategy family (benchmarks/gpu_train_families.py).
#
# Environment: DEVICE (default cuda:0), PROFILE (output file; default $OUT/gpu_profile.json when OUT
# is set, else /tmp/gpu_profile.json), LIMIT_S (time limit of the sweep, default 290).
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE="${DEVICE:-cuda:0}"
PROFILE="${PROFILE:-${OUT:-/tmp}/gpu_profile.json}"
LIMIT_S="${LIMIT_S:-290}"
ACC="${1:-}"
PY="${PYTHON:-python}"

DEVICE="$DEVICE" "$PY" - <<'PY'
import os, torch
if os.environ["DEVICE"] == "cpu":  # a dry run of the script on a machine without a GPU
    raise SystemExit(0)
assert torch.cuda.is_available(), f"no CUDA device visible (torch {torch.__version__}, cuda {torch.version.cuda})"
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name} {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, cuda {torch.version.cuda}")
PY

start=$(date +%s)
timeout --signal=INT --kill-after=10 "$LIMIT_S" \
    "$PY" -c 'import sys; sys.argv[0] = "shardplan"; from planner.cli import main; main()' profile compute --device "$DEVICE" --dtype bf16 --quick -o "$PROFILE"
echo "compute profile: $(( $(date +%s) - start )) s -> $PROFILE"
"$PY" benchmarks/gpu_profile_compare.py "$PROFILE" ${ACC:+--accelerator "$ACC"} \
    --json "${PROFILE%.json}.compare.json"

# then one `shardplan train` per strategy family on the visible GPUs: predicted against measured
# step time and peak memory (TRAIN_LIMIT_S bounds it; TRAIN=0 skips it)
if [ "$DEVICE" != "cpu" ] && [ "${TRAIN:-1}" != "0" ]; then
    timeout --signal=INT --kill-after=10 "${TRAIN_LIMIT_S:-240}" "$PY" benchmarks/gpu_train_families.py --fp8 || true
fi
