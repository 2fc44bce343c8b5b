#!/usr/bin/env bash
# A/B of the early PDL trigger (LLMACCEL_PDL_EARLY) and the GEMVs' L2 weight prefetch
# (LLMACCEL_GEMV_PREFETCH) on batch-1 decode steps of the llama-3.2-3b shape, through
# exp_decode_ab.py (graph replay per step, greedy tokens): each setting "early prefetch" for
# each quantization, then every setting compared with the first of its quantization.
#   bash benchmarks/exp_prefetch_ab.sh OUT_DIR "bf16:00,10 rtn-int4-g128:00,10,11 fp8:00,11"
set -euo pipefail
out=$1; plan=${2:-"bf16:00,10,11 rtn-int4-g128:00,10,11 fp8:00,10,11"}
mkdir -p "$out"
for item in $plan; do
  q=${item%%:*}; first=
  for s in $(echo "${item#*:}" | tr ',' ' '); do
    LLMACCEL_PDL_EARLY=${s:0:1} LLMACCEL_GEMV_PREFETCH=${s:1:1} python benchmarks/exp_decode_ab.py \
      --quantization "$q" --label "early${s:0:1}-pf${s:1:1}" --out "$out/$q-$s.json" > /dev/null
    first=${first:-$s}
  done
done
for item in $plan; do
  q=${item%%:*}; first=$(echo "${item#*:}" | cut -d, -f1)
  for s in $(echo "${item#*:}" | tr ',' ' '); do
    python benchmarks/exp_decode_ab.py --compare "$out/$q-$first.json" "$out/$q-$s.json"
  done
done
