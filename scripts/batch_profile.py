"""Where a batch's time goes: N document-QA requests decoded together in-process (no Ray, no HTTP).

    python scripts/batch_profile.py --requests 8 --method rasd --sizing batch
    python scripts/batch_profile.py --requests 8 --method ar

Prefills every request (one at a time, as the scheduler does), then steps the `BatchDecoder` until all are
done, and prints prefill and decode time, decode and end-to-end tokens/s, forward time per step, tree tokens
per step and committed tokens per row and step. `--sizing request` reproduces the sizing before the batch
sizer (each request sizes its own tree against the single-row curve; the batch caps rows at 64 / B tokens),
for side-by-side comparisons. The same prompts as `rasd load` (the sample index, 4 sources).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from rasd.apps.docqa import RETRIEVAL_METHODS, Source, fit_sources, open_index, scope_proposer
from rasd.decoding.model.loading import load_model
from rasd.decoding.proposers.recycling import RecyclingMatrix
from rasd.decoding.runtime.engine import build_decoder, vocab_size
from rasd.decoding.step.batch_decoder import BatchDecoder
from rasd.eval.load import SAMPLE_QUESTIONS


def streams_for(target: Any, index: Any, method: str, requests: int, max_tokens: int) -> list[Any]:
    """One `GenerationStream` per question, built like the service builds them (shared recycling matrix)."""
    recycling = RecyclingMatrix(vocab_size(target.model))
    out = []
    for question in SAMPLE_QUESTIONS[:requests]:
        sources = [Source.from_hit(h) for h in index.search(question, k=4)]
        ids, sources = fit_sources(target.tokenizer, question, sources, target.max_context - max_tokens - 1)
        extra: dict[str, Any] = {"datastores": index.datastores()} if method in RETRIEVAL_METHODS else {}
        if method in ("rasd", "recycling"):
            extra["recycling"] = recycling
        decoder = build_decoder(target, method, **extra)
        if sources:
            scope_proposer(decoder.proposer, index, sources)
        out.append(decoder.stream(ids, max_tokens, None, target.eos_token_ids, []))
    return out


def per_request_sizing(batch: BatchDecoder, streams: list[Any]) -> None:
    """The sizing before `sizing.batch`: every stream cuts its own tree, the batch caps each row's share."""
    batch._curve = lambda: None            # no batch cost model: `_size` falls back to an equal share
    batch.max_batch_tokens = 64
    for stream in streams:
        propose = stream.propose
        stream.propose = lambda batched=False, _p=propose: _p(batched=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--method", default="rasd")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--sizing", choices=("batch", "request"), default="batch")
    args = ap.parse_args()
    target = load_model("default")
    index = open_index("sample", "default")
    streams = streams_for(target, index, args.method, args.requests, args.max_tokens)
    batch = BatchDecoder(target.model)
    if args.sizing == "request":
        per_request_sizing(batch, streams)
    t0 = time.perf_counter()
    for stream in streams:
        batch.add(stream)
    prefill_s = time.perf_counter() - t0
    forwards: list[float] = []
    widths: list[int] = []
    rows: list[int] = []
    original = batch._verify_and_commit

    def timed(trees: list[Any], draft_s: list[float], forward_s: list[float]) -> Any:
        out = original(trees, draft_s, forward_s)
        forwards.append(forward_s[0])
        widths.append(max(len(t) for t in trees))
        rows.append(len(trees))
        return out

    batch._verify_and_commit = timed       # type: ignore[method-assign]
    t1 = time.perf_counter()
    with torch.inference_mode():
        while len(batch):
            batch.step()
    decode_s = time.perf_counter() - t1
    tokens = sum(len(s.output.token_ids) for s in streams)
    steps = len(forwards)
    print(f"{args.method} x {args.requests} ({args.sizing} sizing): prefill {prefill_s:.1f} s, decode {decode_s:.1f} s,"
          f" {tokens} tokens: decode {tokens / decode_s:.1f} tok/s, end to end {tokens / (prefill_s + decode_s):.1f}"
          f" tok/s")
    print(f"  {steps} steps: forward median {1000 * statistics.median(forwards):.0f} ms, padded width mean "
          f"{statistics.mean(widths):.1f}, rows mean {statistics.mean(rows):.1f}, committed per row and step "
          f"{(tokens - args.requests) / sum(rows):.2f}")


if __name__ == "__main__":
    main()
