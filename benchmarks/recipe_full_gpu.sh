#!/usr/bin/env bash
# The full built-in recipe (`llmaccel run --size full`) on a GPU lease of the device machine,
# whose calls run at most 10 minutes each and whose /tmp lasts only while it stays warm.
# One phase per call, issued back to back; stage outputs stay in /tmp/runs between calls, and
# the cache makes every phase pick up where the last one stopped:
#   bash benchmarks/recipe_full_gpu.sh setup            # wheels (.whl), data (.devdata)
#   bash benchmarks/recipe_full_gpu.sh join [FILE SHA]  # a staged model (default: SmolLM2),
#                                                       # verified, into the model cache
#   bash benchmarks/recipe_full_gpu.sh run [--only ...] # `llmaccel run --size full ...`, or
#                                                       # `llmaccel run $RECIPE ...` if set
#   bash benchmarks/recipe_full_gpu.sh unpack FILE.tgz  # stage dirs from an earlier lease
#   bash benchmarks/recipe_full_gpu.sh pack NAME [GLOB] # stage dirs (or the report) -> $OUT
#   bash benchmarks/recipe_full_gpu.sh work NAME STAGES # run --only STAGES, print what ran,
#                                                       # log and records (pack) -> $OUT
# Another recipe: RECIPE=recipes/qwen-coder-study.yaml RECIPE_NAME=qwen-coder-study (its name:
# where pack and unpack find its stage directories).
# Stages that read only the model (bench.base.*) can run in one lease and be carried into the
# next (pack, then unpack): their cache keys hold the model's bytes, not a path.
set -euo pipefail
phase=$1; shift
model=SmolLM2-135M-Instruct.Q4_1.gguf
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
export PYTHONPATH=$PWD:/tmp/site LLMACCEL_DATA_DIR=/tmp/devdata LLMACCEL_CACHE=/tmp/lc
export PYTHONUNBUFFERED=1 COLUMNS=160
runs=/tmp/runs/${RECIPE_NAME:-default}
case $phase in
  setup)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl
    rm -rf /tmp/devdata && cp -r .devdata /tmp/devdata
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv ;;
  join)
    # a file staged with ../shared/tools/device-stage; the Qwen pair of recipes/
    # qwen-coder-study.yaml goes where ../shared/models/fetch puts it (~/.cache/shared-models)
    model=${1:-$model}; sha=${2:-$sha}
    dest=/tmp/lc/models; [[ $model == qwen* ]] && dest=$HOME/.cache/shared-models
    cat /tmp/stage/$model.part* > /tmp/stage/$model && rm /tmp/stage/$model.part*
    echo "$sha  /tmp/stage/$model" | sha256sum -c
    mkdir -p $dest && mv /tmp/stage/$model $dest/ ;;
  run)
    if [[ -n ${RECIPE:-} ]]; then
      python3 -m llmaccel.cli run "$RECIPE" --runs-dir /tmp/runs "$@"
    else
      python3 -m llmaccel.cli run --size full --runs-dir /tmp/runs "$@"
    fi ;;
  unpack)
    mkdir -p $runs && tar xzf "$1" -C $runs && ls $runs ;;
  pack)
    # stage directories without model weights or tokenizer files (records, manifests,
    # reports): small. Unpacked into a later lease, a convert or quantize directory would
    # read as cached without its weights, so those go only with GLOB naming them.
    name=$1; glob=${2:-}
    [[ -n $glob ]] || glob=$(cd $runs && { ls -d analyze-* eval.* bench.* draft.* spec.* \
                                 report-* 2>/dev/null || true; } | tr '\n' ' ')
    (cd $runs && tar czf "$OUT/$name" --exclude='*.safetensors' --exclude='*.bin' \
       --exclude='tokenizer*' $glob)
    ls -la "$OUT" ;;
  work)
    # one GPU call's share of a recipe: the stages named, a short table of what ran, the
    # log and the finished stage directories (pack) returned under $OUT
    name=$1; stages=$2; rc=0
    bash "$0" run --only "$stages" > /tmp/$name.log 2>&1 || rc=$?
    echo "rc=$rc $(date -u +%H:%M:%S)"
    grep -E "│ .*(ran|failed|skipped) " /tmp/$name.log | cut -c1-150 | tail -40 || true
    grep -E "did not finish" -A3 /tmp/$name.log | cut -c1-400 || true
    cp /tmp/$name.log "$OUT/"
    bash "$0" pack "$name.tgz" > /dev/null ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
