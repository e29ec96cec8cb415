"""Where a method's greedy output leaves HF `generate`'s, and how close HF's own top two logits were there.

Why: in the same dtype our engine and HF compute the same model with other kernels (a packed product, float32
attention on the CPU, a lean forward), so their last bits differ; where HF's two best next tokens are that close,
either pick is the model's greedy answer. A divergence at a wide gap would be a bug. `rasd bench` reports each
divergence (prompt, position, HF's top-2 gap there) instead of a bare match rate, so a reader can judge which is
which; exactness within our engine is the separate match against `ar`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from rasd.eval.datasets import BenchPrompt
from rasd.eval.runners import LLAMACPP, RunRecord, split_dtype


def first_difference(ours: Sequence[int], ref: Sequence[int]) -> int | None:
    """The first position where the two differ (a shorter one that is a prefix differs at its end); None if equal."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=False)):
        if a != b:
            return i
    return None if len(ours) == len(ref) else min(len(ours), len(ref))


@torch.inference_mode()
def top2_gap(model: torch.nn.Module, ids: Sequence[int]) -> tuple[float, float]:
    """HF's own forward (no cache): the gap between its two largest next-token logits after `ids`, and that gap in
    units of the logits' resolution there (the spacing of their dtype at the top logit: a bf16 logit near 20 moves
    in steps of 0.125, so a gap of one or two steps is a tie that rounding decides)."""
    device = next(model.parameters()).device
    raw = model(torch.tensor([list(ids)], device=device)).logits[0, -1]
    top = raw.float().topk(2).values
    gap = float(top[0] - top[1])
    magnitude = max(abs(float(top[0])), torch.finfo(raw.dtype).tiny)
    spacing = torch.finfo(raw.dtype).eps * 2.0 ** math.floor(math.log2(magnitude))
    return gap, gap / spacing


def divergences(model: torch.nn.Module, prompts: Sequence[BenchPrompt], records: Sequence[RunRecord],
                reference: str = "hf") -> list[dict[str, Any]]:
    """Every record whose tokens differ from `reference`'s on the same prompt: where, and HF's top-2 gap there."""
    refs = {r.index: r for r in records if r.method == reference}
    by_index = {p.index: p for p in prompts}
    out = []
    for record in records:
        ref = refs.get(record.index)
        if record.method == reference or ref is None or split_dtype(record.method)[1] is not None:
            continue   # a method in another dtype (`rasd:dtype=float32`) is not HF's computation
        if record.method == LLAMACPP:
            continue   # nor is llama.cpp's quantized one (listed apart: `llamacpp.first_differences`)
        first = first_difference(record.token_ids, ref.token_ids)
        if first is None or first >= min(len(record.token_ids), len(ref.token_ids)):
            continue   # equal, or one stopped earlier (a length, not a token, differs)
        gap, steps = top2_gap(model, by_index[record.index].input_ids + ref.token_ids[:first])
        out.append({"method": record.method, "question_id": record.question_id, "category": record.category,
                    "position": first, "ours": record.token_ids[first], "reference": ref.token_ids[first],
                    "reference_top2_gap": gap, "reference_top2_gap_steps": steps})
    return out


def format_divergences(rows: Sequence[dict[str, Any]], reference: str = "hf", apart: Sequence[str] = ()) -> str:
    """Lines for the terminal: one per divergence, widest gap first. `apart`: methods `divergences` does not compare
    (another dtype, llama.cpp), named so that "every output equals" is not read as covering them."""
    if not rows:
        return f"every greedy output equals {reference}'s" + (f" (not compared: {', '.join(apart)})" if apart else "")
    lines = [f"divergences from {reference} (the first different token; {reference}'s top-2 logit gap there, and in "
             "steps of its logits' dtype resolution there):"]
    for row in sorted(rows, key=lambda r: -r["reference_top2_gap"]):
        lines.append(f"  {row['method']:<10} {row['category']}#{row['question_id']} token {row['position']}: "
                     f"gap {row['reference_top2_gap']:.4g} ({row['reference_top2_gap_steps']:.3g} steps of the "
                     "logits' resolution)")
    return "\n".join(lines)
