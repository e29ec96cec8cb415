#!/usr/bin/env bash
# Builds the two folders that scripts/gpu_run.sh carries to a lent GPU machine (each under the 64 MiB a call takes):
#   .gpu/a: part_aa (the first 50,000,000 bytes of the embedded GGUF), w/ (cp312 wheels the GPU image lacks),
#           tok/ (the tokenizer files of this machine's conversion)
#   .gpu/r: part_ab (the rest of the GGUF), index/ (the sample index), prompts.jsonl (its 16 document-QA prompts),
#           question.jsonl (Spec-Bench) and the ShareGPT conversations (the head's training prompts)
# Why ahead of time: a lent machine's minutes are few (15 in all, its start included); nothing here needs it.
#     bash scripts/gpu_stage.sh        # then: run(carry=[".gpu/a"], "OUT=$OUT bash scripts/gpu_run.sh stage") ...
set -euo pipefail
PY=${PY:-.venv/bin/python}
DATA=${RASD_DATA:-../shared/data}
rm -rf .gpu && mkdir -p .gpu/a/w .gpu/a/tok .gpu/r
gguf=$($PY -c "from rasd.decoding.model.loading import find_gguf; print(find_gguf())")
model=$($PY -c "from rasd.decoding.model.loading import default_model_path; print(default_model_path())")
head -c 50000000 "$gguf" > .gpu/a/part_aa
tail -c +50000001 "$gguf" > .gpu/r/part_ab
cp "$model"/tokenizer* "$model"/chat_template.jinja .gpu/a/tok/ 2>/dev/null || cp "$model"/tokenizer* .gpu/a/tok/
for pkg in gguf pydivsufsort; do
    version=$($PY -c "import importlib.metadata as m; print(m.version('$pkg'))")
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        -d .gpu/a/w "$pkg==$version" 2>&1 | grep -v "^WARNING: Location" || true
    ls .gpu/a/w/"$pkg"-*.whl > /dev/null || { echo "no cp312 wheel of $pkg==$version" >&2; exit 1; }
done
index=$($PY -c "from rasd.apps.sample_corpus import ensure_sample_index; print(ensure_sample_index())" | tail -1)
cp -r "$index" .gpu/r/index
$PY scripts/inprocess_load.py --save-prompts .gpu/r/prompts.jsonl --index sample
cp "$DATA/spec_bench/question.jsonl" "$DATA/sharegpt/sharegpt_v3_first4000.jsonl.gz" .gpu/r/
du -sh .gpu/a .gpu/r   # each must stay under 64 MiB
