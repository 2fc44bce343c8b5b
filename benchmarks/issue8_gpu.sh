#!/usr/bin/env bash
# Issue 8's GPU runs (session 14), on the device machine: `llmaccel eval code` on
# Qwen2.5-Coder-0.5B-Instruct (base bf16 against n-gram speculation and RTN-int8, RTN-int4-g128,
# GPTQ-int4-g128, FP8 checkpoints made here), then `llmaccel bench` latency / throughput / serve
# / prefix on the llama-3.2-1b shape and `llmaccel report` over it all; `code32`: base against
# n-gram in fp32 (after `code`, which makes /tmp/qwen2.5-coder-0.5b-instruct).
#   bash benchmarks/issue8_gpu.sh code|code32|bench OUT_DIR   (the Qwen GGUF staged in /tmp/stage)
set -euo pipefail
part=$1; out=$2
L="python -m llmaccel.cli"
day=2026-11-24
if [[ $part == code ]]; then
  G=/tmp/stage/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
  python -c "import torch; from llmaccel.models.convert import gguf_to_hf_dir; gguf_to_hf_dir('$G', '/tmp/qwen2.5-coder-0.5b-instruct', torch.bfloat16)"
  $L quantize /tmp/qwen2.5-coder-0.5b-instruct --method rtn --bits 8 --out /tmp/qwen2.5-coder-0.5b-instruct-rtn8
  $L quantize /tmp/qwen2.5-coder-0.5b-instruct --method rtn --bits 4 --group-size 128 --out /tmp/qwen2.5-coder-0.5b-instruct-rtn4
  $L quantize /tmp/qwen2.5-coder-0.5b-instruct --method gptq --bits 4 --group-size 128 --out /tmp/qwen2.5-coder-0.5b-instruct-gptq4
  $L quantize /tmp/qwen2.5-coder-0.5b-instruct --method fp8 --out /tmp/qwen2.5-coder-0.5b-instruct-fp8
  $L eval code /tmp/qwen2.5-coder-0.5b-instruct --dtype bfloat16 --out "$out" --name "$day-code-qwen2.5-coder-0.5b-h100" \
    --variant 'ngram={"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}}' \
    --variant 'rtn-int8={"model": "/tmp/qwen2.5-coder-0.5b-instruct-rtn8"}' \
    --variant 'rtn-int4-g128={"model": "/tmp/qwen2.5-coder-0.5b-instruct-rtn4"}' \
    --variant 'gptq-int4-g128={"model": "/tmp/qwen2.5-coder-0.5b-instruct-gptq4"}' \
    --variant 'fp8={"model": "/tmp/qwen2.5-coder-0.5b-instruct-fp8"}'
elif [[ $part == code32 ]]; then
  $L eval code /tmp/qwen2.5-coder-0.5b-instruct --dtype float32 --out "$out" --name "$day-code-qwen2.5-coder-0.5b-fp32-h100" \
    --variant 'ngram={"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}}'
else
  m=llama-3.2-1b
  $L bench latency $m --backend llmaccel,hf-eager,hf-static-compile --out "$out" --name "$day-W1-bench-$m-h100" --no-progress
  $L bench throughput $m --backend llmaccel,hf-cb --out "$out" --name "$day-W2-bench-$m-h100" --no-progress
  $L bench serve $m --backend llmaccel --request-rate 4,16,64,inf --out "$out" --name "$day-W3-bench-$m-h100" --no-progress
  $L bench prefix $m --backend llmaccel --out "$out" --name "$day-W4-bench-$m-h100" --no-progress
  $L report "$out" --out "$out/report" --title "llmaccel bench on an H100 ($m shape, random weights)"
fi
