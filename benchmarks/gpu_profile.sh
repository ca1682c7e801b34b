#!/usr/bin/env bash
# The device checks of one CUDA GPU, each step independent of the others' success (about 8 minutes):
#   1. kernel rates against the cost model's prices (benchmarks/gpu_kernels.py: GEMMs by shape in
#      bf16 and fp8, flash attention by length and head dim, memory-bound kernels by class, MoE
#      grouped GEMMs and permutations, dense GEMMs of few rows);
#   2. a quick compute profile (`shardplan profile compute --quick`) and its bf16 GEMM curve against
#      the accelerator file's peak and gemm_efficiency;
#   3. one `shardplan train` per strategy family (benchmarks/gpu_train_families.py).
#
#   benchmarks/gpu_profile.sh [accelerator]        # accelerator: h200, h100-sxm, ... (default: guessed)
#
# Environment: DEVICE (default cuda:0), PROFILE (output file; default $OUT/gpu_profile.json when OUT
# is set, else /tmp/gpu_profile.json), KERNELS_LIMIT_S (kernel rates, default 200), LIMIT_S (the
# profile's sweep, default 290), TRAIN_LIMIT_S (the training runs, default 240).
set -uo pipefail
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

OUTDIR="$(dirname "$PROFILE")"
if [ "$DEVICE" != "cpu" ]; then
    timeout --signal=INT --kill-after=10 "${KERNELS_LIMIT_S:-200}" "$PY" benchmarks/gpu_kernels.py \
        --device "$DEVICE" ${ACC:+--accelerator "$ACC"} --limit-s $(( ${KERNELS_LIMIT_S:-200} - 40 )) \
        --json "$OUTDIR/gpu_kernels.json" || echo "gpu_kernels.py failed ($?)"
fi

start=$(date +%s)
timeout --signal=INT --kill-after=10 "$LIMIT_S" \
    "$PY" -c 'import sys; sys.argv[0] = "shardplan"; from planner.cli import main; main()' profile compute --device "$DEVICE" --dtype bf16 --quick -o "$PROFILE" || echo "compute profile failed ($?)"
echo "compute profile: $(( $(date +%s) - start )) s -> $PROFILE"
"$PY" benchmarks/gpu_profile_compare.py "$PROFILE" ${ACC:+--accelerator "$ACC"} \
    --json "${PROFILE%.json}.compare.json" || echo "compare failed ($?)"

# then one `shardplan train` per strategy family on the visible GPUs: predicted against measured
# step time and peak memory (TRAIN_LIMIT_S bounds it; TRAIN=0 skips it)
if [ "$DEVICE" != "cpu" ] && [ "${TRAIN:-1}" != "0" ]; then
    timeout --signal=INT --kill-after=10 "${TRAIN_LIMIT_S:-240}" "$PY" benchmarks/gpu_train_families.py --fp8 || true
fi
