#!/usr/bin/env bash
# W1 (batch-1 decode) of our engine with the decode fusions and programmatic dependent launch
# (PDL) switched on and off, one process per setting, appended to one results file:
#
#   bash benchmarks/w1_fusion_ablation.sh SHAPES OUT_DIR NAME [VARIANTS]
#
# SHAPES: comma-separated benchmark shapes; VARIANTS: a subset of "before fused pdl-only async"
# (the first three by default). The plain "llmaccel" row is the default path (fused decode +
# PDL where the GPU has it); the others set LLMACCEL_FUSED_DECODE / LLMACCEL_PDL as their
# label says, and "async" adds async scheduling to the default path.
set -uo pipefail
shapes=${1:?shapes}; out=${2:?out dir}; name=${3:?file stem}; variants=${4:-before fused pdl-only}
common=(--workloads W1 --backends llmaccel --shapes "$shapes" --out "$out" --name "$name"
        --engine-kw 'cudagraph_capture_sizes=[1]')
cd "$(dirname "$0")/.."
extra=()
LLMACCEL_FUSED_DECODE=1 LLMACCEL_PDL=1 python benchmarks/gpu_speed.py "${common[@]}"
for v in $variants; do
  case $v in
    before) env=(LLMACCEL_FUSED_DECODE=0 LLMACCEL_PDL=0); label="unfused, no PDL" ;;
    fused) env=(LLMACCEL_FUSED_DECODE=1 LLMACCEL_PDL=0); label="fused, no PDL" ;;
    pdl-only) env=(LLMACCEL_FUSED_DECODE=0 LLMACCEL_PDL=1); label="unfused, PDL" ;;
    async) env=(LLMACCEL_FUSED_DECODE=1 LLMACCEL_PDL=1); label="async scheduling"
           extra=(--engine-kw async_scheduling=true) ;;
    *) echo "unknown variant $v" >&2; exit 2 ;;
  esac
  env "${env[@]}" python benchmarks/gpu_speed.py "${common[@]}" "${extra[@]}" --append \
    --variant "$label"
  extra=()
done
