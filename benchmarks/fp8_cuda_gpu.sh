#!/usr/bin/env bash
# Issue 5 FP8 on the device: the CUDA C FP8 GEMV's GPU tests, its sweep against the Triton FP8
# GEMV, a replay/token A/B in the engine, and W1 on the 3B shape with each GEMV.
#   bash benchmarks/fp8_cuda_gpu.sh OUT_DIR TAG
set -uo pipefail
out=$1; tag=$2
mkdir -p "$out"
log="$out/$tag.log"
{
  echo "== pytest -m gpu tests/test_kernels_gemv_fp8_cuda.py"
  python3 -m pytest -q -m gpu tests/test_kernels_gemv_fp8_cuda.py -p no:cacheprovider 2>&1 | tail -2
  echo "== exp_fp8_cuda.py"
  python3 benchmarks/exp_fp8_cuda.py --out "$out" 2>&1 | tail -14
  echo "== decode A/B (graph replay, greedy tokens): CUDA FP8 GEMV vs Triton"
  bash benchmarks/exp_env_ab.sh "$out/ab" fp8 cuda=LLMACCEL_CUDA_FP8=1 triton=LLMACCEL_CUDA_FP8=0 \
    2>&1 | tail -1
  rm -rf "$out/ab"
  echo "== W1"
  python3 benchmarks/gpu_speed.py --workloads W1 --shapes llama-3.2-3b --backends llmaccel \
    --quantization bf16,fp8 --repeats 3 --out "$out" --name "W1-$tag-cuda-fp8" \
    --variant cuda-fp8 2>&1 | tail -1
  LLMACCEL_CUDA_FP8=0 python3 benchmarks/gpu_speed.py --workloads W1 --shapes llama-3.2-3b \
    --backends llmaccel --quantization bf16,fp8 --repeats 3 --out "$out" \
    --name "W1-$tag-triton-fp8" --variant triton-fp8 2>&1 | tail -1
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
