#!/usr/bin/env bash
# Issue 5 on the device, in two calls on one warm machine:
#   bash benchmarks/w4_cuda_gpu.sh OUT_DIR TAG tune   GPU tests, the CUDA C GEMV's tile sweep
#        (its fastest tiles merged into this GPU's table, copied to OUT_DIR/table.json), and
#        a greedy-token/replay A/B of the qkv rope epilogue in the engine
#   bash benchmarks/w4_cuda_gpu.sh OUT_DIR TAG w1     W1 on the 3B shape (bf16, GPTQ int4,
#        GPTQ int4 + int4 head) with the rope epilogue on and off, with the committed table and
#        with TABLE_BEFORE (a table file, if set), then a per-kernel profile of a decode step
set -uo pipefail
out=$1; tag=$2; part=$3
mkdir -p "$out"
log="$out/$tag-$part.log"
w1() {  # W1 on the 3B shape: NAME QUANTS, env from the caller
  python3 benchmarks/gpu_speed.py --workloads W1 --shapes llama-3.2-3b --backends llmaccel \
    --quantization "$2" --repeats 3 --out "$out" --name "W1-$tag-$1" --variant "$1" 2>&1 | tail -1
  rm -f "$out/W1-$tag-$1.md"  # the jsonl holds it; $OUT brings back 8 files
}
{
  if [ "$part" = tune ]; then
    echo "== pytest -m gpu (CUDA GEMV, paged attention, rotary)"
    python3 -m pytest -q -m gpu tests/test_kernels_gemv_w4_cuda.py \
      tests/test_kernels_paged_attention.py tests/test_kernels_fused_decode.py -p no:cacheprovider \
      2>&1 | tail -2
    echo "== exp_w4_cuda.py --out-table auto"
    python3 benchmarks/exp_w4_cuda.py --out "$out" --out-table auto 2>&1 | grep -v "^  cuda-"
    cp "$(python3 -c 'from llmaccel.kernels.gemm_tuning import table_path; print(table_path())')" \
      "$out/table.json"
    echo "== decode A/B (graph replay, greedy tokens): qkv rope epilogue on / off"
    bash benchmarks/exp_env_ab.sh "$out/ab" gptq-int4-g128 rope=LLMACCEL_QKV_ROPE_EPILOGUE=1 \
      no-rope=LLMACCEL_QKV_ROPE_EPILOGUE=0 2>&1 | tail -1
    rm -rf "$out/ab"
  else
    echo "== W1"
    w1 default bf16,gptq-int4-g128,gptq-int4-g128-lm-head
    LLMACCEL_QKV_ROPE_EPILOGUE=0 w1 no-rope gptq-int4-g128,gptq-int4-g128-lm-head
    if [ -n "${TABLE_BEFORE:-}" ]; then
      LLMACCEL_GEMM_CONFIGS=$TABLE_BEFORE w1 table-before gptq-int4-g128,gptq-int4-g128-lm-head
    fi
    echo "== profile of a decode step (gptq-int4-g128-lm-head, CUDA GEMV)"
    python3 benchmarks/profile_decode.py --shape llama-3.2-3b \
      --quantization gptq-int4-g128-lm-head --kernels --rows 16 --steps 50 2>&1 | tail -24
    echo "== W1 tok/s"
    python3 - "$out" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("W1-*.jsonl")):
    for line in open(f):
        r = json.loads(line)
        if r["metric"] == "tok_s":
            print(f"{f.stem:40} {r['config']['quantization']:26} {r['value']:8.1f}")
PY
  fi
} > "$log" 2>&1
cat "$log"
