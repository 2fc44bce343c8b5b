#!/usr/bin/env bash
# Issue 5 on the device: L2 prefetch of the next GEMV's weights (kernels/l2_prefetch.py).
#   bash benchmarks/l2_prefetch_gpu.sh OUT_DIR TAG chain   GPU tests, the GEMV chains with
#        each cap (int4 and FP8), and a replay/greedy-token A/B in the engine (int4 + int4 head)
#   bash benchmarks/l2_prefetch_gpu.sh OUT_DIR TAG w1  W1 on the 3B shape (bf16, GPTQ int4,
#        GPTQ int4 + int4 head, FP8) with the default cap, then with prefetch off (session 26
#        also ran a cap across the attention, LLMACCEL_L2_PREFETCH_ATTN_MB, since removed)
#   bash benchmarks/l2_prefetch_gpu.sh OUT_DIR TAG step  GPU tests of the step's input kernel
#        (kernels/stage_inputs.py) and the paths it touches, the gaps between decode steps (int4
#        + int4 head), then W1 with it and without it (LLMACCEL_STAGE_KERNEL=0)
set -uo pipefail
out=$1; tag=$2; part=$3
mkdir -p "$out"
log="$out/$tag-$part.log"
w1() {  # NAME [QUANTS], env from the caller
  python3 benchmarks/gpu_speed.py --workloads W1 --shapes llama-3.2-3b --backends llmaccel \
    --quantization "${2:-bf16,gptq-int4-g128,gptq-int4-g128-lm-head,fp8}" --repeats 3 \
    --out "$out" \
    --name "W1-$tag-$1" --variant "$1" 2>&1 | tail -1
  rm -f "$out/W1-$tag-$1.md"
}
{
  if [ "$part" = chain ]; then
    echo "== pytest -m gpu (L2 prefetch, CUDA GEMVs)"
    python3 -m pytest -q -m gpu tests/test_l2_prefetch.py tests/test_kernels_gemv_w4_cuda.py \
      tests/test_kernels_gemv_fp8_cuda.py -p no:cacheprovider 2>&1 | tail -2
    echo "== exp_l2_prefetch.py (int4)"
    python3 benchmarks/exp_l2_prefetch.py --out "$out/int4" 2>&1 | tail -18
    echo "== exp_l2_prefetch.py --fp8"
    python3 benchmarks/exp_l2_prefetch.py --out "$out/fp8" --fp8 --caps 0,8,16,24,32 2>&1 | tail -14
    cat "$out/int4/exp_l2_prefetch.jsonl" "$out/fp8/exp_l2_prefetch.jsonl" \
      > "$out/$tag-chain.jsonl"
    rm -rf "$out/int4" "$out/fp8"
    echo "== decode A/B (graph replay, greedy tokens): prefetch 24 MiB / off / 8 MiB"
    bash benchmarks/exp_env_ab.sh "$out/ab" gptq-int4-g128-lm-head \
      pf24=LLMACCEL_L2_PREFETCH_MB=24 off=LLMACCEL_L2_PREFETCH_MB=0 \
      pf8=LLMACCEL_L2_PREFETCH_MB=8 2>&1 | tail -4
    rm -rf "$out/ab"
  elif [ "$part" = step ]; then
    echo "== pytest -m gpu (stage kernel, L2 prefetch, async scheduling)"
    python3 -m pytest -q -m gpu tests/test_stage_inputs.py tests/test_l2_prefetch.py \
      tests/test_async_scheduling.py tests/test_chain_decode.py tests/test_spec_overlap.py \
      -p no:cacheprovider 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -8
    echo "== gaps between decode steps"
    python3 benchmarks/profile_step_gaps.py --quantization gptq-int4-g128-lm-head \
      --show-steps 1 2>&1 | grep -v -i warn | tail -22
    echo "== W1"
    w1 step-fix
    LLMACCEL_STAGE_KERNEL=0 w1 no-step-fix
  else
    echo "== W1"
    w1 prefetch
    LLMACCEL_L2_PREFETCH_MB=0 w1 no-prefetch
  fi
  if [ "$part" != chain ]; then
    echo "== W1 tok/s (decode-only tok/s)"
    python3 - "$out" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("W1-*.jsonl")):
    recs = [json.loads(line) for line in open(f)]
    dec = {r["config"]["quantization"]: r["value"] for r in recs if r["metric"] == "decode_tok_s"}
    for r in recs:
        if r["metric"] == "tok_s":
            q = r["config"]["quantization"]
            print(f"{f.stem:32} {q:24} {r['value']:8.1f} ({dec.get(q, 0):.1f})")
PY
  fi
} > "$log" 2>&1
cat "$log"
