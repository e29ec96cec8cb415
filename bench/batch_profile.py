"""Where a batch's time goes: N document-QA requests decoded together in-process (no Ray, no HTTP).

    python bench/batch_profile.py --requests 8 --method rasd
    python bench/batch_profile.py --requests 8 --method ar

Prefills every request (one at a time, as the scheduler does), then steps the `BatchDecoder` until all are
done, and prints prefill and decode time, decode and end-to-end tokens/s, forward time per step, tree tokens
per step and committed tokens per row and step. The same prompts as `rasd load` (the sample index, 4 sources).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from rasd.apps.docqa import Source, fit_sources, open_index
from rasd.decoding.model.loading import load_model
from rasd.decoding.proposers.recycling import RecyclingMatrix
from rasd.decoding.proposers.registry import method_spec
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
        spec = method_spec(method)
        extra: dict[str, Any] = {"datastores": index.datastores()} if spec.uses_index else {}
        if spec.uses_recycling:
            extra["recycling"] = recycling
        decoder = build_decoder(target, method, **extra)
        if sources:
            decoder.proposer.scope(index.source_tokens(sources))
        out.append(decoder.stream(ids, max_tokens, None, target.eos_token_ids, []))
    return out


def profile(batch: BatchDecoder, streams: list[Any]) -> dict[str, Any]:
    """Prefill every stream into `batch`, step it until all are done; the timings and per-step counts."""
    t0 = time.perf_counter()
    for stream in streams:
        batch.add(stream)
    prefill_s = time.perf_counter() - t0
    forwards: list[float] = []
    widths: list[int] = []
    rows: list[int] = []
    original = batch._verify_and_commit

    def timed(trees: list[Any], draft_s: list[float], forward_s: list[float], job: Any = None) -> Any:
        out = original(trees, draft_s, forward_s, job)
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
    return {"prefill_s": prefill_s, "decode_s": decode_s, "tokens": tokens, "forwards": forwards,
            "widths": widths, "rows": rows, "requests": len(streams)}


def summary(method: str, r: dict[str, Any]) -> str:
    """Two lines: times and rates, then the per-step medians and means."""
    tokens, prefill_s, decode_s = r["tokens"], r["prefill_s"], r["decode_s"]
    return (f"{method} x {r['requests']}: prefill {prefill_s:.1f} s, decode {decode_s:.1f} s, {tokens} tokens: "
            f"decode {tokens / decode_s:.1f} tok/s, end to end {tokens / (prefill_s + decode_s):.1f} tok/s\n"
            f"  {len(r['forwards'])} steps: forward median {1000 * statistics.median(r['forwards']):.0f} ms, "
            f"padded width mean {statistics.mean(r['widths']):.1f}, rows mean {statistics.mean(r['rows']):.1f}, "
            f"committed per row and step {(tokens - r['requests']) / sum(r['rows']):.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--method", default="rasd")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    target = load_model("default")
    index = open_index("sample", "default")
    streams = streams_for(target, index, args.method, args.requests, args.max_tokens)
    print(summary(args.method, profile(BatchDecoder(target.model), streams)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
