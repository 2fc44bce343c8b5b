#!/usr/bin/env bash
# Issue 7's draft-head runs on the device machine, in parts that fit one call each (10 min).
# Parts after `join` read what earlier parts left under /tmp (the converted models, $HEAD_DIR),
# so they run back to back on one warm machine, in one batch of calls. The GGUF files are
# staged under /tmp/stage first (../shared/tools/device-stage).
#
#   bash benchmarks/head_gpu.sh OUT_DIR TAG PART
#
# join   the staged GGUF files from their chunks, checked; then each converted once to a bf16
#        HF directory (/tmp/stage/q15, q05): a GGUF load parses its 151,936-token vocabulary
#        twice (config and weights share one parse since s40, models/gguf_loading.py; the
#        tokenizer has its own; ~28 s each on the device's CPU) and dequantizes on the CPU
#        (111 s in s39 for the 1.5B; ~25% less expected since s40), and every later load
#        reads safetensors instead; the 0.5B only where its chunks
#        were staged (the draft model of `w5`: parts without it need not stage it); an
#        earlier session's head staged in pieces under /tmp/stage/<name>-head/ (its config,
#        draft vocabulary and model.safetensors.partNN, 15 MiB each) is joined there too, so
#        INIT_HEAD or a sweep's init_head can start from it
# data   self-distillation text (benchmarks/head_data.py), DATA_SECONDS of generation
#        (DATA_SEQS: the engine's max_num_seqs, default 256; DATA_STEP_TOKENS, e.g. 768: the
#        step token budget and CUDA graphs up to as many rows, head_data.py --max-step-tokens), from
#        requests drawn with SEED; returned gzipped ($tag-head-data.txt.gz) and joined to the
#        text of earlier sessions: benchmarks/head_text/*.txt.gz (committed: copy the returned
#        file there, so the head's data grows from session to session, each having only ~30
#        device minutes; a checkout's ignored .headstate/ did not survive into the next
#        session's fresh checkout, and session 38's 14M tokens were lost that way), and any
#        .headstate/*.txt.gz
# trainspeed  the head's training step, variants side by side (exp_head_train_speed.py) on
#        the 1.5B's shape with random weights (no staged files needed)
# warm   a plain head on it (exp_head_unroll.py --stage warm), TRAIN_SECONDS (the cosine
#        follows the time limit: train/loop.py); from INIT_HEAD where set (an earlier
#        session's head, staged), at peak lr LR; the target's features computed once per
#        block first (--cache-features, train/feature_cache.py) unless CACHE is empty; AUX:
#        EAGLE-3's multi-layer features (--aux-layers, e.g. 2,14; empty: the final hidden
#        state only); PREV=1: the previous token's embedding too (--prev-token, its part
#        starting at PREV_INIT); ATTN_INIT=random: the layer's q/k drawn afresh; on a fresh
#        machine (no `data` part run) the data is the earlier sessions' text (above), after
#        COPY doubled WikiText-2 paragraphs where COPY is set
#        The head comes back in pieces of 15 MiB (a call returns at most 8 files, 64 MiB
#        together): `warm` returns its config, draft vocabulary and pieces 0-3, and `w5head`
#        the rest, so no call is spent on them alone (a separate call came too late once:
#        the machine is released after 30 s idle); PIECES=0: neither returns them. `cat`
#        them into model.safetensors to stage the head again next session (INIT_HEAD)
#        RECORDS=1: blocks start at chat records (--record-start '<|im_start|>system'), so an
#        answer's prompt is in its block; WARM_LR: a fresh head's peak lr (default 5e-4);
#        COPY_ATTN: the copy-attention loss's weight (--copy-attention-weight; session 37's
#        best 0.1) on COPY_HEADS query heads (default 2; COPY_SPREAD=1: one per key/value
#        group in turn, not the first ones); COPY_ALL=1: with an unrolled WARM_VARIANT (e.g.
#        unroll3-decay0.5-detach), that loss at every unrolled step (--copy-attention-all-steps)
# warmbg `warm` started in the background (setsid: the device tool ends a call's processes when
#        it returns, except those in a new session), so training can run past one call's 600 s;
#        its output goes to $H/bgout and its log to $H/warmbg.log. TRAIN_SECONDS ~900 in
#        session 42's plan. Then, call after call, back to back (the machine goes back after
#        30 s idle): `waitwarm`, which waits up to WAIT seconds (default 570) for it to end,
#        prints the log's tail, and on the end copies its files to OUT_DIR; rc 3 while it runs
# sweep  several fresh heads side by side on one feature cache (exp_head_sweep.py), SWEEP
#        (';'-separated DistillConfig settings), SWEEP_SECONDS each, into $H/sweep/v<i>;
#        PREV and RECORDS as for warm; a table with copy top-1 and attention sink share
# savehead N  the same pieces on their own: N=0 config, draft vocabulary, distill.json and
#        pieces 0-3; N=1 the rest
# cont   continue it in each of VARIANTS (exp_head_unroll.py's; default unrolled and
#        detached, session 24's best), CONT_SECONDS each, from the warm head
# w5head W5 at batch 1 with HEAD (default the warm head; K its most drafts, default 4;
#        REPEATS timed runs, default 5): OVERLAP (off,on), FIRST (lookup
#        first: off), LOOKUP (its most drafts), TOPK (tree verification, spec/tree.py), VOCABS
#        (--draft-vocab-sizes, e.g. auto,16384: a smaller LM head per draft step)
# w5hybrid  W5 at batch 1 with HEAD, n-gram lookup first (SpeculativeConfig.ngram_first;
#        LOOKUP_MIN: its shortest match, default 2)
# w5     W5 at batch 1: n-gram and the 0.5B draft model, same settings
# tests  the GPU tests of the head and of overlapped drafting
# Every part prints the time at its start and end (start-up costs are most of a call).
# The device machine has no gguf package (join's conversion needs it) and its copy of the tree
# no git: carry a gguf wheel in .whl (README of the device tool), install it to /tmp/site and
# put that and the repo on PYTHONPATH in every call, and pass LLMACCEL_COMMIT=<sha> for the
# results' commit field, e.g.
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl;
#   export PYTHONPATH=$PWD:/tmp/site LLMACCEL_COMMIT=<sha>; bash benchmarks/head_gpu.sh ...
set -euo pipefail
out=$1; tag=$2; part=$3  # (savehead takes a 4th: which half)
mkdir -p "$out"
H=${HEAD_DIR:-/tmp/h}
T15=/tmp/stage/q15
T05=/tmp/stage/q05
DATA_SECONDS=${DATA_SECONDS:-120}
TRAIN_SECONDS=${TRAIN_SECONDS:-420}
CACHE=${CACHE-1}  # warm: --cache-features (CACHE= turns it off)
AUX=${AUX-}  # warm: --aux-layers
PREV=${PREV-}  # warm/cont: --prev-token (the token at each feature's position) when set
PREV_INIT=${PREV_INIT:-0.1}  # warm: --prev-token-init
ATTN_INIT=${ATTN_INIT:-target}  # warm: --attention-init (random: fresh q/k, INIT_HEAD's too)
COPY=${COPY:-0}  # warm, on a fresh machine: WikiText paragraphs written twice, first in the data
RECORDS=${RECORDS:-0}  # warm/sweep: blocks start at chat records
RECORD_START="<|im_start|>system"
WARM_VARIANT=${WARM_VARIANT:-plain}  # warm: exp_head_unroll.py's variant settings
CONT_SECONDS=${CONT_SECONDS:-300}
# warm: batch, steps between evaluations, held-out blocks each scores (all at the end). An
# evaluation of all ~1,000 held-out blocks took ~21 s (s34), about half of a 400 s run; a
# step with the cache and the draft-vocabulary loss ~14 ms at batch 8 (s35, random weights)
BATCH=${BATCH:-8}
EVAL_EVERY=${EVAL_EVERY:-2000}
EVAL_BLOCKS=${EVAL_BLOCKS-128}  # empty: all of them
# warm: the held-out tenth of the blocks capped at this many (empty: no cap). Scoring all of
# session 38's 3,106 took ~70 s of a ~600 s call; 1,000 (512k tokens) took ~21 s (s34)
MAX_HELDOUT=${MAX_HELDOUT-1000}
VARIANTS=${VARIANTS:-unroll3-decay0.5-detach}  # cont
HEAD=${HEAD:-$H/warm}
SWITCH=${SWITCH:-auto}  # spec_bench --switch: auto, on (speculate every round), or auto,on
OVERLAP=${OVERLAP:-off,on}  # w5head: --draft-overlap
FIRST=${FIRST:-off}  # w5head: --ngram-first (off, on, or off,on)
LOOKUP=${LOOKUP:-k}  # w5head/w5hybrid: --prompt-lookup-num-tokens (k: the head's k), e.g. k,7
TOPK=${TOPK:-1}  # w5head: --draft-topk (tree verification: candidates per depth), e.g. 1,3
W5="python benchmarks/spec_bench.py --target $T15 --batches 1 --kinds code,prose --k ${K:-4}
    --max-tokens 192 --repeats ${REPEATS:-5} --dtype bfloat16 --switch $SWITCH --out $out"
quiet() { grep -v "Converting and de-quantizing\|Loading weights" || true; }
echo "$part start $(date +%T)"

join() {  # a staged file's chunks -> the file, checked (../shared/tools/device-stage)
  local f=/tmp/stage/$1 sha=$2
  if compgen -G "$f.part*" > /dev/null; then
    cat "$f".part* > "$f" && rm "$f".part*
  fi
  echo "$sha  $f" | sha256sum -c
}

pieces() {  # the warm head's pieces into $out: 0 -> config, vocabulary, pieces 0-3; 1 -> the rest
  [[ -f $H/warm/model.safetensors && ${PIECES:-1} != 0 ]] || return 0
  mkdir -p "$H/pieces"
  [[ -f $H/pieces/model.safetensors.part00 ]] \
    || split -b 15M -d "$H/warm/model.safetensors" "$H/pieces/model.safetensors.part"
  sha256sum "$H/warm/model.safetensors"
  if [[ $1 == 0 ]]; then
    cp "$H/warm/config.json" "$H/warm/draft_vocab.json" "$out/"
    cp "$H"/pieces/*part0[0-3] "$out/"
  else
    find "$H/pieces" -name '*part*' ! -name '*part0[0-3]' -exec cp {} "$out/" \;
  fi
}

earlier() {  # earlier sessions' self-distillation text, oldest first (names sort by date)
  local f
  for f in benchmarks/head_text/*.txt.* .headstate/*.txt.*; do  # one glob each: by date
    [[ -f $f ]] || continue
    case $f in
      *.gz) gzip -dc "$f" ;;
      # python's lzma, not xz(1): the device image need not have xz-utils
      *.xz) python3 -c "import lzma, shutil, sys
shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)" "$f" ;;
    esac
  done
  return 0
}

convert() {  # GGUF -> bf16 HF directory, once
  [[ -f $2/config.json ]] || python -c "import sys, torch
from llmaccel.models.convert import gguf_to_hf_dir
gguf_to_hf_dir(sys.argv[1], sys.argv[2], torch.bfloat16, return_model=False)" "$1" "$2" 2>&1 | quiet | tail -2
}

case $part in
  join)
    join qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
      cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
    convert /tmp/stage/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf "$T15"
    for d in /tmp/stage/*-head; do  # a staged head's pieces
      if compgen -G "$d/model.safetensors.part*" > /dev/null; then
        cat "$d"/model.safetensors.part* > "$d/model.safetensors" && rm "$d"/model.safetensors.part*
        sha256sum "$d/model.safetensors"
      fi
    done
    # the 0.5B (the draft model, `w5` only) where it was staged
    if compgen -G "/tmp/stage/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf*" > /dev/null; then
      join qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
        1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
      convert /tmp/stage/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf "$T05"
    fi
    ;;
  data)
    mkdir -p "$H"
    python benchmarks/head_data.py --target "$T15" --n "${DATA_N:-16384}" --max-tokens 256 --chunk 2048 \
      --seed "${SEED:-0}" --max-seconds "$DATA_SECONDS" --out "$H/new.txt" \
      ${DATA_SEQS:+--max-num-seqs "$DATA_SEQS"} ${DATA_STEP_TOKENS:+--max-step-tokens "$DATA_STEP_TOKENS"} \
      2>&1 | quiet \
      | tee "$out/$tag-data.log"
    gzip -9 -c "$H/new.txt" > "$out/$tag-head-data.txt.gz"
    # earlier sessions' text first: the held-out set is the last 10%, this session's
    { earlier; cat "$H/new.txt"; } > "$H/data.txt"
    ls -l "$H"/*.txt
    ;;
  warm|sweep)
    if [[ ! -f $H/data.txt ]]; then  # a fresh machine: the carried text of earlier sessions
      mkdir -p "$H"
      { [[ $COPY != 0 ]] && python -c "import sys
from benchmarks.exp_head_prev_token import copy_text
print(copy_text(int(sys.argv[1])))" "$COPY"
        earlier; } > "$H/data.txt"
      ls -l "$H/data.txt"
    fi
    records=()
    if [[ $RECORDS != 0 ]]; then records=(--record-start "$RECORD_START"); fi
    if [[ $part == sweep ]]; then
      python benchmarks/exp_head_sweep.py --target "$T15" --data "$H/data.txt" --out "$H/sweep" \
        --variants "$SWEEP" --seconds "${SWEEP_SECONDS:-80}" --eval-every "${SWEEP_EVAL_EVERY:-1000}" \
        ${PREV:+--prev-token} "${records[@]}" 2>&1 | quiet | tee "$out/$tag-sweep.txt" | tail -12
      for d in "$H"/sweep/v*; do cp "$d/distill.json" "$out/$tag-sweep-$(basename "$d").json"; done
      echo "$part end $(date +%T)"; exit 0
    fi
    python benchmarks/exp_head_unroll.py --target "$T15" --data "$H/data.txt" --stage warm \
      --warm-steps 100000 --warm-seconds "$TRAIN_SECONDS" --out "$H" --batch-size "$BATCH" \
      --eval-every "$EVAL_EVERY" ${EVAL_BLOCKS:+--eval-blocks "$EVAL_BLOCKS"} \
      ${MAX_HELDOUT:+--max-heldout-blocks "$MAX_HELDOUT"} \
      ${CACHE:+--cache-features} ${AUX:+--aux-layers "$AUX"} ${PREV:+--prev-token --prev-token-init "$PREV_INIT"} \
      --warm-variant "$WARM_VARIANT" --attention-init "$ATTN_INIT" ${INIT_HEAD:+--init-head "$INIT_HEAD" --lr "${LR:-3e-4}"} \
      ${WARM_LR:+--warm-lr "$WARM_LR"} "${records[@]}" \
      --copy-attention-weight "${COPY_ATTN:-0}" --copy-attention-heads "${COPY_HEADS:-2}" \
      ${COPY_SPREAD:+--copy-attention-spread} ${COPY_ALL:+--copy-attention-all-steps} 2>&1 \
      | quiet | tail -3
    cp "$H/warm/distill.json" "$out/$tag-warm-distill.json"
    pieces 0
    ;;
  warmbg)
    mkdir -p "$H/bgout"
    rm -f "$H/warmbg.rc"
    # from a copy of the tree: each call gets a fresh copy of the working tree, which must
    # not change under a process still importing from it
    rm -rf /tmp/bgrepo && mkdir /tmp/bgrepo && cp -a benchmarks llmaccel /tmp/bgrepo/
    (cd /tmp/bgrepo && PYTHONPATH=/tmp/bgrepo${PYTHONPATH:+:$PYTHONPATH} setsid bash -c \
      'bash benchmarks/head_gpu.sh "$1" "$2" warm; echo $? > "$3"' _ \
      "$H/bgout" "$tag" "$H/warmbg.rc" > "$H/warmbg.log" 2>&1 < /dev/null &)
    sleep 2; echo "started in the background from /tmp/bgrepo, log $H/warmbg.log"
    ;;
  waitwarm)
    wait_s=${WAIT:-570}
    while [[ ! -f $H/warmbg.rc ]] && (( SECONDS < wait_s )); do sleep 5; done
    tail -4 "$H/warmbg.log" 2>/dev/null || true
    if [[ ! -f $H/warmbg.rc ]]; then echo "still running after ${SECONDS} s"; exit 3; fi
    cp "$H"/bgout/* "$out/" 2>/dev/null || true
    echo "ended with rc $(cat "$H/warmbg.rc")"
    ;;
  trainspeed)
    python benchmarks/exp_head_train_speed.py --target qwen2.5-1.5b --blocks 256 --steps 40 \
      --out "$out" --name "$tag-head-train-speed" 2>&1 | tail -7
    ;;
  savehead)
    [[ ${4:-0} == 0 ]] && cp "$H/warm/distill.json" "$out/$tag-head-distill.json"
    pieces "${4:-0}"
    ls -l "$out"
    ;;
  cont)
    python benchmarks/exp_head_unroll.py --target "$T15" --data "$H/data.txt" --stage continue \
      --variants "$VARIANTS" --steps 100000 --seconds "$CONT_SECONDS" --out "$H" \
      --batch-size "$BATCH" ${EVAL_BLOCKS:+--eval-blocks "$EVAL_BLOCKS"} ${CACHE:+--cache-features} \
      ${PREV:+--prev-token} 2>&1 | quiet | tail -8
    for v in ${VARIANTS//,/ }; do cp "$H/$v/distill.json" "$out/$tag-cont-$v-distill.json"; done
    ;;
  w5head)
    $W5 --methods head --head "$HEAD" --draft-overlap "$OVERLAP" --ngram-first "$FIRST" \
      --prompt-lookup-num-tokens "$LOOKUP" --prompt-lookup-min "${LOOKUP_MIN:-2}" \
      --draft-topk "$TOPK" ${VOCABS:+--draft-vocab-sizes "$VOCABS"} --name "$tag-W5-head" 2>&1 \
      | quiet | tail -12
    [[ $HEAD == "$H/warm" ]] && pieces 1
    ;;
  w5hybrid)
    $W5 --methods head --head "$HEAD" --ngram-first on --prompt-lookup-min "${LOOKUP_MIN:-2}" \
      --prompt-lookup-num-tokens "$LOOKUP" --name "$tag-W5-head-ngram-first" 2>&1 | quiet \
      | tail -8
    ;;
  w5)
    $W5 --methods ngram,draft --draft "$T05" --disable-by-batch-size draft=4 \
      --name "$tag-W5-ngram-draft" 2>&1 | quiet | tail -8
    ;;
  tests)
    python -m pytest -q -p no:cacheprovider -m gpu tests/test_spec_head_overlap.py \
      tests/test_spec_head.py tests/test_spec_overlap.py tests/test_head_aux_layers.py \
      tests/test_spec_tree.py tests/test_kernels_paged_attention.py tests/test_head_prev_token.py 2>&1 | tail -8 \
      | tee "$out/$tag-gpu-tests.txt"
    ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
echo "$part end $(date +%T)"
