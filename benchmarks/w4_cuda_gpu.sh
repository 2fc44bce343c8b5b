#!/usr/bin/env bash
# Issue 5 on the device: the CUDA C int4 GEMV's GPU tests, [its tile sweep against the Triton
# GEMV,] a greedy-token/replay A/B in the engine, W1 on the 3B shape with each GEMV, and a
# per-kernel profile of an int4 decode step.
#   bash benchmarks/w4_cuda_gpu.sh OUT_DIR TAG [sweep]
set -uo pipefail
out=$1; tag=$2; sweep=${3:-}
mkdir -p "$out"
log="$out/$tag.log"
w1() {  # W1 on the 3B shape: NAME VARIANT QUANTS, env from the caller
  python3 benchmarks/gpu_speed.py --workloads W1 --shapes llama-3.2-3b --backends llmaccel \
    --quantization "$3" --repeats 3 --out "$out" --name "W1-$tag-$1" --variant "$2" 2>&1 | tail -1
}
{
  echo "== pytest -m gpu (CUDA GEMV, paged attention)"
  python3 -m pytest -q -m gpu tests/test_kernels_gemv_w4_cuda.py \
    tests/test_kernels_paged_attention.py -p no:cacheprovider 2>&1 | tail -2
  if [ -n "$sweep" ]; then
    echo "== exp_w4_cuda.py"
    python3 benchmarks/exp_w4_cuda.py --out "$out" 2>&1 | grep -v "^  cuda-"
  fi
  echo "== decode A/B (graph replay, greedy tokens): CUDA GEMV vs Triton GEMV"
  bash benchmarks/exp_env_ab.sh "$out/ab" gptq-int4-g128 cuda=LLMACCEL_CUDA_KERNELS=1 \
    triton=LLMACCEL_CUDA_KERNELS=0 2>&1 | tail -1
  rm -rf "$out/ab"
  echo "== W1"
  w1 default default bf16,gptq-int4-g128,gptq-int4-g128-lm-head
  LLMACCEL_CUDA_KERNELS=0 w1 triton-gemv triton-gemv gptq-int4-g128,gptq-int4-g128-lm-head
  echo "== profile of a decode step (gptq-int4-g128-lm-head, CUDA GEMV)"
  python3 benchmarks/profile_decode.py --shape llama-3.2-3b --quantization gptq-int4-g128-lm-head \
    --kernels --rows 16 --steps 50 2>&1 | tail -24
  echo "== W1 tok/s"
  python3 - "$out" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("W1-*.jsonl")):
    for line in open(f):
        r = json.loads(line)
        if r["metric"] == "tok_s":
            print(f"{f.stem:40} {r['config']['quantization']:26} {r['value']:8.1f}")
PY
} > "$log" 2>&1
cat "$log"
