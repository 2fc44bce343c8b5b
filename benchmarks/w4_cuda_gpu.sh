#!/usr/bin/env bash
# Issue 5 on the device: the CUDA C int4 GEMV's GPU tests, its tile sweep against the Triton
# GEMV, a greedy-token/replay A/B in the engine, and W1 on the 3B shape with each GEMV.
#   bash benchmarks/w4_cuda_gpu.sh OUT_DIR TAG
set -uo pipefail
out=$1; tag=$2
mkdir -p "$out"
log="$out/$tag.log"
{
  echo "== pytest -m gpu tests/test_kernels_gemv_w4_cuda.py"
  python3 -m pytest -q -m gpu tests/test_kernels_gemv_w4_cuda.py -p no:cacheprovider 2>&1 | tail -4
  echo "== exp_w4_cuda.py"
  python3 benchmarks/exp_w4_cuda.py --out "$out" 2>&1 | grep -v "^  cuda-"
  echo "== decode A/B (graph replay, greedy tokens): CUDA GEMV fused / unfused, Triton GEMV"
  bash benchmarks/exp_env_ab.sh "$out/ab" gptq-int4-g128 cuda-fused=LLMACCEL_CUDA_KERNELS=1 \
    cuda-unfused=LLMACCEL_CUDA_FUSED_DECODE=0 triton=LLMACCEL_CUDA_KERNELS=0 2>&1 | tail -6
  rm -rf "$out/ab"
  echo "== W1"
  python3 benchmarks/gpu_speed.py --workloads W1 --shapes llama-3.2-3b --backends llmaccel \
    --quantization bf16,gptq-int4-g128,gptq-int4-g128-lm-head --repeats 3 --out "$out" \
    --name "W1-$tag-cuda-gemv" --variant cuda-gemv-fused 2>&1 | tail -3
  LLMACCEL_CUDA_FUSED_DECODE=0 python3 benchmarks/gpu_speed.py --workloads W1 \
    --shapes llama-3.2-3b --backends llmaccel --quantization gptq-int4-g128,gptq-int4-g128-lm-head \
    --repeats 3 --out "$out" --name "W1-$tag-cuda-gemv-unfused" --variant cuda-gemv-unfused \
    2>&1 | tail -3
  LLMACCEL_CUDA_KERNELS=0 python3 benchmarks/gpu_speed.py --workloads W1 --shapes llama-3.2-3b \
    --backends llmaccel --quantization bf16,gptq-int4-g128,gptq-int4-g128-lm-head --repeats 3 \
    --out "$out" --name "W1-$tag-triton-gemv" --variant triton-gemv 2>&1 | tail -3
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
