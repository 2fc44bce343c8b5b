#!/usr/bin/env bash
# Issue 9's GPU runs (session 15), on the device machine: W3 on the llama-3.2-1b shape (random
# weights) in one lease — our engine in process (`bench serve --backend llmaccel`), then
# through the OpenAI API (`llmaccel serve` + `bench serve --backend openai`), same loads and
# engine settings, so the records of one file give the server's cost. /metrics is scraped after
# each server run (KV usage must be back to 0, request counts must match what was sent).
# An optional third run repeats the two highest loads with the interpreter's GIL switch
# interval lowered (an experiment: the engine thread and the event loop share one GIL).
#   bash benchmarks/issue9_gpu.sh OUT_DIR [SWITCH_INTERVAL_S]
set -euo pipefail
out=$1; switch=${2:-}
L="python -m llmaccel.cli"
day=2026-11-24
m=llama-3.2-1b
rates=4,16,64,inf
mkdir -p "$out"

serve_and_bench() {  # name, label, request rates, then the command that runs our CLI
  local name=$1 label=$2 r=$3; shift 3
  "$@" serve $m --load-format dummy --max-model-len 1536 --no-enable-prefix-caching \
    --port 8000 --log-level warning > "$out/$name.serve.log" 2>&1 &
  local pid=$!
  for i in $(seq 300); do curl -sf localhost:8000/health > /dev/null && break; sleep 1; done
  curl -sf localhost:8000/health > /dev/null || { tail -30 "$out/$name.serve.log"; exit 1; }
  $L bench serve $m --backend openai --base-url http://127.0.0.1:8000 --server-name "$label" \
    --request-rate "$r" --out "$out" --name "$name" --no-progress
  curl -sf localhost:8000/metrics > "$out/$name.metrics.txt"
  kill -TERM $pid; wait $pid || echo "server exit status $?"
  grep -E "^llmaccel:(kv_cache_usage_perc|num_requests_running|num_requests_waiting|request_success_total|generation_tokens_total)" \
    "$out/$name.metrics.txt"
}

$L bench serve $m --backend llmaccel --request-rate $rates --out "$out" --name "$day-W3-inproc-$m-h100" --no-progress
serve_and_bench "$day-W3-llmaccel-serve-$m-h100" llmaccel $rates python -m llmaccel.cli
cat "$out/$day-W3-inproc-$m-h100.jsonl" "$out/$day-W3-llmaccel-serve-$m-h100.jsonl" > "$out/$day-W3-api-vs-inproc-$m-h100.jsonl"
if [[ -n $switch ]]; then
  serve_and_bench "$day-W3-switch$switch-$m-h100" "llmaccel-switch$switch" 64,inf python -c \
    "import sys; sys.setswitchinterval(float(sys.argv[1])); sys.argv = ['llmaccel'] + sys.argv[2:]; from llmaccel.cli import main; main()" "$switch"
fi
