#!/usr/bin/env bash
# A/B of decode-path switches read from the environment at import: for one quantization, runs
# benchmarks/exp_decode_ab.py once per setting (graph replay per batch-1 step, greedy tokens),
# then compares every setting with the first.
#   bash benchmarks/exp_env_ab.sh OUT_DIR QUANT NAME=VAR=VALUE[,VAR=VALUE...] ...
# e.g. bash benchmarks/exp_env_ab.sh out fp8 on=LLMACCEL_NORM_QUANT=1 off=LLMACCEL_NORM_QUANT=0
# (graph replay can mislead for launch-order changes: decide those in W1, see exp_decode_ab.py)
set -euo pipefail
out=$1; q=$2; shift 2
mkdir -p "$out"
names=()
for setting in "$@"; do
  name=${setting%%=*}; vars=${setting#*=}
  names+=("$name")
  env $(echo "$vars" | tr ',' ' ') python benchmarks/exp_decode_ab.py --quantization "$q" \
    --label "$name" --out "$out/$q-$name.json" > /dev/null
done
for name in "${names[@]}"; do
  python benchmarks/exp_decode_ab.py --compare "$out/$q-${names[0]}.json" "$out/$q-$name.json"
done
