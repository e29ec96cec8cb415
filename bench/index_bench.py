"""Measure the retrieval index: suffix-array lookup latency on a 10M-token datastore, and building an index
of the WikiText-2 test corpus (time and size on disk).

    .venv/bin/python bench/index_bench.py [--data ../shared/data] [--tokens 10000000] [--json out.json]

Why it is built this way:
- The datastore is real text (WikiText-2 paragraphs + ShareGPT conversations) tokenized with the default
  target tokenizer, repeated until it holds `--tokens` tokens, because match lengths and occurrence counts
  (and so the lookup cost) depend on real text statistics, not on random tokens.
- Contexts come from held-out documents (every 20th one is kept out of the datastore), so the measured
  lookups include misses and short matches the way a new request would, not only exact copies.
- Lookups run against the arrays memory-mapped from .npy files, as `Index.open` serves them, after one
  untimed pass so the pages are resident (a steady-state server's situation).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HOLD_OUT_EVERY = 20


def read_texts(data: Path) -> list[str]:
    """WikiText-2 test paragraphs, then every turn of the first 4000 ShareGPT conversations."""
    texts = []
    with open(data / "corpus" / "wikitext2_raw_test" / "paragraphs.jsonl", encoding="utf-8") as fh:
        texts.extend(json.loads(line)["text"] for line in fh if line.strip())
    with gzip.open(data / "sharegpt" / "sharegpt_v3_first4000.jsonl.gz", "rt", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                texts.extend(t["value"] for t in json.loads(line).get("conversations", []) if t.get("value"))
    return texts


def tokenize(texts: list[str]) -> list[np.ndarray]:
    from rasd.index.chunking import load_tokenizer, tokenize_documents

    return [t.ids for t in tokenize_documents(load_tokenizer("default"), texts, progress=True, batch_size=256)]


def make_contexts(held_out: list[np.ndarray], count: int, rng: np.random.Generator) -> list[list[int]]:
    """`count` contexts: the 32 tokens before a random position of a random held-out document."""
    docs = [d for d in held_out if len(d) > 40]
    out = []
    for _ in range(count):
        doc = docs[int(rng.integers(len(docs)))]
        end = int(rng.integers(32, len(doc)))
        out.append(doc[end - 32:end].tolist())
    return out


def bench_lookup(docs: list[np.ndarray], contexts: list[list[int]], target_tokens: int) -> dict[str, Any]:
    """Build the datastore (repeating docs up to `target_tokens`), memory-map it, time the lookups."""
    from rasd.index.suffix_array import SuffixArray, build_suffix_array, join_documents

    base = sum(len(d) + 1 for d in docs)
    repeats = max(1, -(-target_tokens // base))
    tokens, _ = join_documents(docs * repeats)
    tokens = tokens[:target_tokens]
    t0 = time.perf_counter()
    sa = build_suffix_array(tokens)
    build_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp) / "tokens.npy", tokens)
        np.save(Path(tmp) / "sa.npy", sa)
        del sa
        store = SuffixArray.load(Path(tmp) / "tokens.npy", Path(tmp) / "sa.npy", mmap=True)
        for ctx in contexts:                                  # warm the page cache, untimed
            store.lookup(ctx)
        times, lengths, found = [], [], 0
        for ctx in contexts:
            t = time.perf_counter()
            length, conts = store.lookup(ctx)
            times.append(time.perf_counter() - t)
            found += bool(conts)
            lengths.append(length)
    times_ms = np.array(times) * 1e3
    return {"datastore_tokens": int(len(tokens)), "unique_source_tokens": int(base), "repeats": repeats,
            "suffix_array_build_s": round(build_s, 2), "contexts": len(contexts),
            "lookup_median_ms": round(float(np.median(times_ms)), 3),
            "lookup_p99_ms": round(float(np.percentile(times_ms, 99)), 3),
            "lookup_mean_ms": round(float(times_ms.mean()), 3),
            "found_rate": round(found / len(contexts), 3),
            "mean_match_length": round(statistics.fmean(lengths), 2)}


def bench_build(data: Path) -> dict[str, Any]:
    """Build an index of the WikiText-2 test paragraphs with defaults; time, size on disk, a search's latency."""
    from rasd.index import build_index

    source = data / "corpus" / "wikitext2_raw_test" / "paragraphs.jsonl"
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        index = build_index([source], Path(tmp) / "wikitext", progress=True)
        build_s = time.perf_counter() - t0
        files = {}
        for entry in index.manifest["segments"]:
            for name, meta in entry["files"].items():
                files[name] = files.get(name, 0) + int(meta["bytes"])
        manifest_bytes = (Path(tmp) / "wikitext" / "manifest.json").stat().st_size
        index.search("warm up", k=5)
        t = time.perf_counter()
        queries = ["Who starred in the television series The Bill?", "tropical storm damage in Mexico",
                   "the history of the Roman army", "a famous battle in 1942", "species of birds and their eggs"]
        for q in queries * 4:
            index.search(q, k=5)
        search_ms = (time.perf_counter() - t) / (len(queries) * 4) * 1e3
        return {"source": str(source), "documents": index.num_documents, "chunks": index.num_chunks,
                "tokens": index.num_tokens, "build_s": round(build_s, 1),
                "bytes_on_disk": sum(files.values()) + manifest_bytes, "bytes_per_file": files,
                "search_ms": round(search_ms, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data")
    parser.add_argument("--tokens", type=int, default=10_000_000, help="datastore size for the lookup benchmark")
    parser.add_argument("--contexts", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-build", action="store_true", help="only the lookup benchmark")
    parser.add_argument("--skip-lookup", action="store_true", help="only the index build benchmark")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    results: dict[str, Any] = {"cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()[0]}
    if not args.skip_lookup:
        rng = np.random.default_rng(args.seed)
        t0 = time.perf_counter()
        docs = tokenize(read_texts(args.data))
        results["tokenize_corpus_s"] = round(time.perf_counter() - t0, 1)
        held_out = docs[::HOLD_OUT_EVERY]
        kept = [d for i, d in enumerate(docs) if i % HOLD_OUT_EVERY and len(d)]
        results["lookup"] = bench_lookup(kept, make_contexts(held_out, args.contexts, rng), args.tokens)
        print(json.dumps(results["lookup"], indent=2), file=sys.stderr)
    if not args.skip_build:
        results["wikitext_index"] = bench_build(args.data)
    results["load_average_at_end"] = os.getloadavg()[0]   # > cpus means other work competed for the CPU
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
