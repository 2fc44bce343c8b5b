#!/usr/bin/env bash
# Issue 7's draft-head runs on the device machine, in parts that fit one call each (10 min).
# Parts after `train` read what earlier parts left in $HEAD_DIR, so they run back to back on
# one warm machine. The GGUF files are staged under /tmp/stage (../shared/tools/device-stage).
#
#   bash benchmarks/head_gpu.sh OUT_DIR TAG PART
#
# join   the staged GGUF files from their chunks, checked
# train  self-distillation data (benchmarks/head_data.py) and a plain warm head
#        (exp_head_unroll.py --stage warm); --data-seconds / --train-seconds below
# cont   continue that head with unrolled, detached training (the best variant of session 24),
#        then W5 at batch 1 with it, overlap off and on
# w5     W5 at batch 1: n-gram and the 0.5B draft model, same settings; then the GPU tests of
#        the head and of overlapped drafting
set -euo pipefail
out=$1; tag=$2; part=$3
mkdir -p "$out"
H=${HEAD_DIR:-/tmp/h}
G15=/tmp/stage/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
G05=/tmp/stage/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
DATA_SECONDS=${DATA_SECONDS:-190}
TRAIN_SECONDS=${TRAIN_SECONDS:-270}
CONT_SECONDS=${CONT_SECONDS:-200}
W5="python benchmarks/spec_bench.py --target $G15 --batches 1 --kinds code,prose --k 4
    --max-tokens 192 --repeats 5 --dtype bfloat16 --switch auto --out $out"
quiet() { grep -v "Converting and de-quantizing" || true; }

join() {  # a staged file's chunks -> the file, checked (../shared/tools/device-stage)
  local f=/tmp/stage/$1 sha=$2
  if compgen -G "$f.part*" > /dev/null; then
    cat "$f".part* > "$f" && rm "$f".part*
  fi
  echo "$sha  $f" | sha256sum -c
}

case $part in
  join)
    join qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
      cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
    join qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
      1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
    ;;
  train)
    mkdir -p "$H"
    python benchmarks/head_data.py --target "$G15" --n 8192 --max-tokens 256 --chunk 2048 \
      --max-seconds "$DATA_SECONDS" --out "$H/data.txt" 2>&1 | quiet | tee "$out/$tag-data.log"
    python benchmarks/exp_head_unroll.py --target "$G15" --data "$H/data.txt" --stage warm \
      --warm-steps 3000 --warm-seconds "$TRAIN_SECONDS" --out "$H" 2>&1 | quiet \
      | tail -5 | tee "$out/$tag-warm.log"
    cp "$H/warm/distill.json" "$out/$tag-warm-distill.json"
    ;;
  cont)
    python benchmarks/exp_head_unroll.py --target "$G15" --data "$H/data.txt" --stage continue \
      --variants unroll3-decay0.5-detach --steps 800 --seconds "$CONT_SECONDS" --out "$H" \
      2>&1 | quiet | tail -5 | tee "$out/$tag-cont.log"
    cp "$H/unroll3-decay0.5-detach/distill.json" "$out/$tag-cont-distill.json"
    $W5 --methods head --head "$H/unroll3-decay0.5-detach" --draft-overlap off,on \
      --name "$tag-head" 2>&1 | quiet | tail -12
    ;;
  w5)
    $W5 --methods ngram,draft --draft "$G05" --disable-by-batch-size draft=4 \
      --name "$tag-ngram-draft" 2>&1 | quiet | tail -12
    python -m pytest -q -p no:cacheprovider -m gpu tests/test_spec_head_overlap.py \
      tests/test_spec_head.py tests/test_spec_overlap.py 2>&1 | tail -5 \
      | tee "$out/$tag-gpu-tests.txt"
    ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
