"""Measure `pld`, `retrieval` and `rasd` settings on document QA with the embedded model (greedy, CPU).

Why a script: choosing retrieval defaults (continuations N, length L, pruning) needs the real model and a
datastore of relevant text, which the tests cannot afford. LongBench rows give documents and questions: the
prompt holds the first `--chunk-tokens` tokens of a row's document and its question (what docqa would put
there); the datastore holds every selected row's whole document, and the request is scoped to its own.
Every method's tokens are checked against our `ar` (itself equal to HF greedy, see the tests).

    python scripts/measure_retrieval.py [--rows 4] [--max-new-tokens 96] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from rasd.decoding.engine import build_decoder
from rasd.decoding.fusion import PruneConfig
from rasd.decoding.models import load_model
from rasd.index.suffix_array import SuffixArray

DATA = Path(__file__).parents[1] / "../shared/data/longbench/longbench_dev.jsonl"
DATASETS = ("multifieldqa_en", "qasper", "gov_report")
EOS = 2

# label -> (method, proposer options)
SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "ar": ("ar", {}),
    "pld": ("pld", {}),
    "retrieval N16 L8": ("retrieval", {}),
    "retrieval N64 L8": ("retrieval", {"max_continuations": 64}),
    "retrieval N16 L16": ("retrieval", {"length": 16}),
    "retrieval N8 L4": ("retrieval", {"max_continuations": 8, "length": 4}),
    "rasd b4": ("rasd", {}),
    "rasd b2": ("rasd", {"prune_config": PruneConfig(max_branches=2)}),
    "rasd b8 share.1": ("rasd", {"prune_config": PruneConfig(max_branches=8, min_share=0.1)}),
}


def rows(n: int) -> list[dict[str, Any]]:
    """The first n rows of DATASETS (round robin), with a document and a question."""
    by_set: dict[str, list[dict[str, Any]]] = {d: [] for d in DATASETS}
    for line in DATA.read_text().splitlines():
        r = json.loads(line)
        if r["dataset"] in by_set and r.get("context") and r.get("question"):
            by_set[r["dataset"]].append(r)
    out = []
    for i in range(n):
        for d in DATASETS:
            if len(out) < n and i < len(by_set[d]):
                out.append(by_set[d][i])
    return out


def chat_prompt(tok: Any, doc_ids: list[int], question: str, chunk: int) -> list[int]:
    text = tok.decode(doc_ids[:chunk])
    content = f"Answer the question based on the document.\n\n{text}\n\nQuestion: {question}"
    enc = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True)
    return [int(t) for t in enc["input_ids"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--chunk-tokens", type=int, default=1000)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    loaded = load_model("default")
    tok = loaded.tokenizer
    selected = rows(args.rows)
    docs = [tok(r["context"])["input_ids"] for r in selected]
    store = SuffixArray.from_documents(docs)
    prompts = [chat_prompt(tok, d, r["question"], args.chunk_tokens) for d, r in zip(docs, selected, strict=True)]
    print(f"{len(prompts)} prompts ({[len(p) for p in prompts]} tokens), datastore {len(store)} tokens",
          file=sys.stderr)
    reference: dict[int, list[int]] = {}
    results = []
    for label in args.settings.split(","):
        method, options = SETTINGS[label]
        decoder = build_decoder(loaded, method, datastores=[store], **options)
        for prompt in prompts:      # measure (or load) cost curves before timing anything
            if hasattr(decoder.sizer, "curve_for"):
                decoder.sizer.curve_for(len(prompt))
        accepted, speed, draft_s, pruned, by_source = [], [], 0.0, 0, {}
        for i, (prompt, doc) in enumerate(zip(prompts, docs, strict=True)):
            if hasattr(decoder.proposer, "scope"):
                decoder.proposer.scope([doc])
            t0 = time.perf_counter()
            out = decoder.generate(prompt, args.max_new_tokens, eos_token_ids={EOS})
            wall = time.perf_counter() - t0
            ref = reference.setdefault(i, out.token_ids)
            assert out.token_ids == ref, f"{label}: prompt {i} differs from ar"
            accepted.append(out.stats.mean_accepted_tokens)
            speed.append(out.stats.tokens_per_s)
            draft_s += out.stats.draft_time_s
            pruned += out.stats.pruned_nodes
            for k, v in out.stats.accepted_by_source.items():
                by_source[k] = by_source.get(k, 0) + v
            print(f"  {label} #{i}: {len(out.token_ids)} tokens, {wall:.1f}s, {out.stats.summary()}", file=sys.stderr)
        row = {"setting": label, "mean_accepted_tokens": round(statistics.mean(accepted), 3),
               "decode_tokens_per_s": round(statistics.mean(speed), 2), "draft_time_s": round(draft_s, 2),
               "pruned_nodes": pruned, "accepted_by_source": by_source}
        results.append(row)
        print(json.dumps(row))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
