#!/usr/bin/env bash
# Issue 9's GPU run (session 15), on the device machine: W3 on the llama-3.2-1b shape (random
# weights) twice in one lease — our engine in process (`bench serve --backend llmaccel`), then
# through the OpenAI API (`llmaccel serve` + `bench serve --backend openai`), same loads and
# engine settings, so the records of one file give the server's cost. /metrics is scraped after
# the run (KV usage must be back to 0, request counts must match what was sent).
#   bash benchmarks/issue9_gpu.sh OUT_DIR
set -euo pipefail
out=$1
L="python -m llmaccel.cli"
day=2026-11-24
m=llama-3.2-1b
rates=4,16,64,inf
mkdir -p "$out"
$L bench serve $m --backend llmaccel --request-rate $rates --out "$out" --name "$day-W3-inproc-$m-h100" --no-progress
$L serve $m --load-format dummy --max-model-len 1536 --no-enable-prefix-caching --port 8000 \
  --log-level warning > "$out/serve.log" 2>&1 &
pid=$!
for i in $(seq 300); do curl -sf localhost:8000/health > /dev/null && break; sleep 1; done
curl -sf localhost:8000/health > /dev/null || { tail -30 "$out/serve.log"; exit 1; }
$L bench serve $m --backend openai --base-url http://127.0.0.1:8000 --server-name llmaccel \
  --request-rate $rates --out "$out" --name "$day-W3-server-$m-h100" --no-progress
curl -sf localhost:8000/metrics > "$out/$day-W3-server-$m-h100.metrics.txt"
kill -TERM $pid; wait $pid || echo "server exit status $?"
cat "$out/$day-W3-inproc-$m-h100.jsonl" "$out/$day-W3-server-$m-h100.jsonl" > "$out/$day-W3-api-vs-inproc-$m-h100.jsonl"
grep -E "^llmaccel:(kv_cache_usage_perc|num_requests_running|num_requests_waiting|request_success_total|generation_tokens_total|prompt_tokens_total)" \
  "$out/$day-W3-server-$m-h100.metrics.txt"
