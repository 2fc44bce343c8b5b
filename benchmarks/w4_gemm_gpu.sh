#!/usr/bin/env bash
# Issue 5 on the device: the tensor-core W4A16 GEMM for 2+ rows (kernels/gemm_w4_cuda.py).
#   bash benchmarks/w4_gemm_gpu.sh OUT_DIR TAG kernel  GPU tests, then exp_w4_gemm.py (every
#        tile against dequantize + cuBLAS, the Triton kernel and cuBLAS bf16, 3B shapes)
#   bash benchmarks/w4_gemm_gpu.sh OUT_DIR TAG w1  W1 on the 3B shape: bf16, GPTQ int4 and
#        GPTQ int4 + int4 head with the GEMM (its default bound, or LLMACCEL_W4_GEMM_MAX_M), then
#        the int4 rows without it (LLMACCEL_W4_GEMM=0)
#   bash benchmarks/w4_gemm_gpu.sh OUT_DIR TAG tests  the GPU tests of the W4 GEMM and of the
#        paged decode attention
#   bash benchmarks/w4_gemm_gpu.sh OUT_DIR TAG gemv-table  exp_w4_cuda.py: the batch-1 GEMV's
#        tiles per 3B shape, the fastest merged into this GPU's table (copied to OUT_DIR)
#   bash benchmarks/w4_gemm_gpu.sh OUT_DIR TAG w1-attn  W1 bf16 and GPTQ int4 + int4 head with
#        the decode attention's step inputs read after its PDL wait (LLMACCEL_ATTN_EARLY_INPUTS=0)
#   bash benchmarks/w4_gemm_gpu.sh OUT_DIR TAG w1-wgmma  W1 on the 3B shape: bf16, GPTQ int4 and
#        GPTQ int4 + int4 head with the wgmma GEMM for prefill rows (sm_90), then int4 + int4 head
#        without it (LLMACCEL_W4_WGMMA=0)
#   bash benchmarks/w4_gemm_gpu.sh OUT_DIR TAG w1-kv  W1 on the 3B shape: bf16, GPTQ int4 and
#        GPTQ int4 + int4 head with the decode attention's K/V of earlier steps read before its
#        PDL wait (the default), then bf16 and int4 + int4 head with it after
#        (LLMACCEL_ATTN_EARLY_KV=0)
#   bash benchmarks/w4_gemm_gpu.sh OUT_DIR TAG w2  W2 (offline throughput): bf16 and GPTQ int4
#        with the GEMM, then GPTQ int4 without it
set -uo pipefail
out=$1; tag=$2; part=$3
mkdir -p "$out"
log="$out/$tag-$part.log"
w1() {  # NAME QUANTS, env from the caller
  python3 benchmarks/gpu_speed.py --workloads W1 --shapes llama-3.2-3b --backends llmaccel \
    --quantization "$2" --repeats "${REPEATS:-3}" --out "$out" --name "W1-$tag-$1" --variant "$1" 2>&1 \
    | tail -1
  rm -f "$out/W1-$tag-$1.md"
}
show_w1() {  # FILE...: each W1 record's file, quantization, metric and value
  python3 - "$@" <<'PY'
import json, sys
for path in sys.argv[1:]:
    for line in open(path):
        r = json.loads(line)
        print(path.split("/")[-1], r["config"].get("quantization"), r["metric"], r["value"])
PY
}
{
  if [ "$part" = kernel ]; then
    echo "== pytest -m gpu tests/test_kernels_gemm_w4_cuda.py"
    python3 -m pytest -q -m gpu tests/test_kernels_gemm_w4_cuda.py -p no:cacheprovider 2>&1 \
      | tail -3
    echo "== exp_w4_gemm.py"
    python3 benchmarks/exp_w4_gemm.py --out "$out" ${ROWS:+--rows $ROWS} 2>&1 | tail -40
    mv "$out/exp_w4_gemm.jsonl" "$out/$tag-kernel.jsonl"
  elif [ "$part" = tests ]; then
    python3 -m pytest -q -m gpu tests/test_kernels_gemm_w4_cuda.py \
      tests/test_kernels_paged_attention.py -p no:cacheprovider 2>&1 | tail -3
  elif [ "$part" = gemv-table ]; then
    python3 benchmarks/exp_w4_cuda.py --out "$out" --out-table auto 2>&1 | tail -9
    mv "$out/exp_w4_cuda.jsonl" "$out/$tag-gemv-table.jsonl"
    cp "$(python3 -c 'import torch; from llmaccel.kernels.gemm_tuning import CONFIG_DIR, device_file_name
print(CONFIG_DIR / device_file_name(torch.cuda.get_device_name()))')" "$out/"
  elif [ "$part" = w1-attn ]; then
    echo "== W1, attention step inputs after the PDL wait"
    LLMACCEL_ATTN_EARLY_INPUTS=0 w1 attn-late bf16,gptq-int4-g128-lm-head
    show_w1 "$out/W1-$tag-attn-late.jsonl"
  elif [ "$part" = w1 ]; then
    echo "== W1 with the W4 GEMM (default bound, LLMACCEL_W4_GEMM_MAX_M=${LLMACCEL_W4_GEMM_MAX_M:-default})"
    w1 gemm bf16,gptq-int4-g128,gptq-int4-g128-lm-head
    echo "== W1 without it"
    LLMACCEL_W4_GEMM=0 w1 no-gemm gptq-int4-g128,gptq-int4-g128-lm-head
    show_w1 "$out"/W1-"$tag"-*.jsonl
  elif [ "$part" = w1-wgmma ]; then
    echo "== W1 with the wgmma GEMM"
    w1 wgmma bf16,gptq-int4-g128,gptq-int4-g128-lm-head
    echo "== W1 without it"
    LLMACCEL_W4_WGMMA=0 w1 no-wgmma gptq-int4-g128-lm-head
    show_w1 "$out"/W1-"$tag"-*.jsonl
  elif [ "$part" = w1-kv ]; then
    echo "== W1, decode attention K/V of earlier steps before the PDL wait"
    w1 early-kv bf16,gptq-int4-g128,gptq-int4-g128-lm-head
    echo "== W1, all K/V after the wait"
    LLMACCEL_ATTN_EARLY_KV=0 w1 late-kv bf16,gptq-int4-g128-lm-head
    show_w1 "$out"/W1-"$tag"-*.jsonl
  elif [ "$part" = w2 ]; then
    for v in gemm no-gemm; do
      echo "== W2 ($v)"
      [ $v = gemm ] && q=bf16,gptq-int4-g128 || q=gptq-int4-g128
      ( [ $v = no-gemm ] && export LLMACCEL_W4_GEMM=0
        python3 benchmarks/gpu_speed.py --workloads W2 --shapes llama-3.2-3b \
          --backends llmaccel --quantization $q --out "$out" --name "W2-$tag-$v" \
          --variant $v 2>&1 | tail -1 )
      rm -f "$out/W2-$tag-$v.md"
      grep -h out_tok_s "$out/W2-$tag-$v.jsonl" | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l); print(r.get('quantization'), r['metric'], r['value'])"
    done
  fi
} 2>&1 | tee "$log"
