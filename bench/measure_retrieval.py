"""Measure `pld`, `retrieval` and `rasd` settings on document QA with the embedded model (greedy, CPU).

Why a script: choosing retrieval defaults (continuations N, length L, pruning) needs the real model and a
datastore of relevant text, which the tests cannot afford. LongBench rows give documents and questions: the
prompt holds the first `--chunk-tokens` tokens of a row's document and its question (what docqa would put
there); the datastore holds every selected row's whole document, and the request is scoped to its own.
Every method's tokens are checked against our `ar` (itself equal to HF greedy, see the tests).

    python bench/measure_retrieval.py [--rows 4] [--max-new-tokens 96] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from rasd.decoding.drafting.fusion import PruneConfig
from rasd.decoding.model.loading import load_model
from rasd.decoding.runtime.engine import build_decoder
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
    "recycling": ("recycling", {}),
    "recycling tmpl": ("recycling", {"shape": "template"}),
    "rasd norec": ("rasd", {"recycling": None}),
    "rasd b4": ("rasd", {}),
    "rasd rec-prune": ("rasd", {"prune_with": "recycling"}),
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


def run_one(decoder: Any, prompt: list[int], doc: list[int], max_new_tokens: int) -> tuple[list[int], Any]:
    """One greedy generation scoped to its document: (new tokens, statistics)."""
    if hasattr(decoder.proposer, "scope"):
        decoder.proposer.scope([doc])
    out = decoder.generate(prompt, max_new_tokens, eos_token_ids={EOS})
    return out.token_ids, out.stats


def summarise(label: str, stats: list[Any]) -> dict[str, Any]:
    """Means over runs; decode tokens/s as total decode tokens over total decode time (robust to short runs)."""
    by_source: dict[str, int] = {}
    for s in stats:
        for k, v in s.accepted_by_source.items():
            by_source[k] = by_source.get(k, 0) + v
    steps = sum(s.steps for s in stats)
    return {"setting": label,
            "mean_accepted_tokens": round(sum(s.num_accepted_tokens + s.steps for s in stats) / max(steps, 1), 3),
            "decode_tokens_per_s": round(sum(s.new_tokens - 1 for s in stats) / sum(s.decode_time_s for s in stats), 2),
            "median_run_tokens_per_s": round(statistics.median(s.tokens_per_s for s in stats), 2),
            "mean_tree_nodes": round(sum(sum(s.tree_sizes) for s in stats) / max(steps, 1), 2),
            "verify_ms_per_step": round(1000 * sum(s.verify_time_s for s in stats) / max(steps, 1), 1),
            "draft_ms_per_step": round(1000 * sum(s.draft_time_s for s in stats) / max(steps, 1), 2),
            "pruned_nodes": sum(s.pruned_nodes for s in stats), "accepted_by_source": by_source}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--chunk-tokens", type=int, default=1000)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma list; the first is the reference")
    ap.add_argument("--repeats", type=int, default=1)
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
    labels = args.settings.split(",")
    decoders = {}
    for label in labels:
        method, options = SETTINGS[label]
        decoders[label] = build_decoder(loaded, method, datastores=[store], **options)
        for prompt in prompts:      # measure (or load) cost curves before timing anything
            curve_for = getattr(decoders[label].sizer, "curve_for", None)
            for n in range(len(prompt), len(prompt) + args.max_new_tokens + 1) if curve_for else ():
                curve_for(n)
    runs: dict[str, list[tuple[list[int], Any]]] = {label: [] for label in labels}
    for rep in range(args.repeats):
        for i, (prompt, doc) in enumerate(zip(prompts, docs, strict=True)):
            shift = (i + rep) % len(labels)          # rotate the order: load spikes hit every setting alike
            for label in labels[shift:] + labels[:shift]:
                runs[label].append(run_one(decoders[label], prompt, doc, args.max_new_tokens))
                print(f"  {label} #{i}: {runs[label][-1][1].summary()}  load {os.getloadavg()[0]:.1f}", file=sys.stderr)
    results, reference = [], runs[labels[0]]
    for label in labels:
        for (got, _), (ref, _) in zip(runs[label], reference, strict=True):
            assert got == ref, f"{label} differs from {labels[0]}"
        results.append(summarise(label, [stats for _, stats in runs[label]]))
        print(json.dumps(results[-1]))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
