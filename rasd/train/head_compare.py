"""Two or more EAGLE heads for one target, compared position by position on the same held-out text.

Why: the held-out set of `rasd train eagle` is a few thousand positions, so each head's agreement carries a
standard error of about 0.007, as large as what one more draw of training text adds. Two heads read the same
positions, though: the paired difference (head B right where A is wrong, minus the reverse) cancels what the
positions share and separates heads whose agreements the report cannot. Its standard error is taken over
held-out sequences (positions of one answer are not independent draws).

    python bench/compare_heads.py REFERENCE.safetensors CANDIDATE.safetensors [MORE ...]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rasd.train.eagle_head import DEPTHS, position_hits


@dataclass(frozen=True)
class PairedDifference:
    """Head B's top-1 agreement minus head A's at one draft depth, over the positions both were scored on."""

    depth: int
    difference: float
    se: float
    positions: int


def paired_differences(hits_a: torch.Tensor, hits_b: torch.Tensor, ok: torch.Tensor) -> list[PairedDifference]:
    """hits_a, hits_b, ok: [D, K, R] bool (depth, held-out sequence, root). The difference of means is a ratio
    of per-sequence sums; its standard error is the cluster-robust one over the K sequences."""
    out = []
    for d in range(hits_a.shape[0]):
        diff_k = (hits_b[d].long() - hits_a[d].long()).sum(-1).double()        # [K]
        n_k = ok[d].sum(-1).double()                                              # [K]
        n, k = float(n_k.sum()), int((n_k > 0).sum())
        mean = float(diff_k.sum()) / n if n else 0.0
        spread = float(((diff_k - mean * n_k) ** 2).sum())
        se = math.sqrt(spread * k / (k - 1)) / n if n and k > 1 else float("nan")
        out.append(PairedDifference(d + 1, mean, se, int(n)))
    return out


def compare_heads(target: Any, heads: list[Path], data: str = "builtin", eval_seqs: int = 128,
                  model_name: str = "default") -> dict[str, Any]:
    """Each head's top-1 by depth and its paired difference against `heads[0]`, on the held-out text that
    `rasd train eagle` scores (the target's greedy continuations, cached under $RASD_HOME)."""
    from rasd.decoding.model.eagle_head import head_taps, load_head
    from rasd.train.common import generation_cache
    from rasd.train.eagle_head import _rows, held_out_set, held_out_split, held_out_windows

    windows = held_out_windows(target.tokenizer, held_out_split(_rows(data), eval_seqs)[1])
    eos = set(target.eos_token_ids or ())
    by_taps: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    scored = []
    for path in heads:
        taps = head_taps(path)
        if taps not in by_taps:
            by_taps[taps] = held_out_set(target.model, windows, 48, eos, generation_cache(model_name), taps=taps)
        seqs, feats, valid = by_taps[taps]
        head = load_head(target.model, path, model_name)
        hit1, _, ok = position_hits(head, seqs, feats, valid, windows.shape[1])
        scored.append((path, hit1, ok))
    _, ref_hits, ref_ok = scored[0]
    rows = []
    for path, hit1, ok in scored:
        if not torch.equal(ok, ref_ok):
            raise ValueError(f"{path} was scored on other positions than {heads[0]}")
        top1 = [round(float(hit1[d].sum()) / max(int(ok[d].sum()), 1), 4) for d in range(DEPTHS)]
        rows.append({"head": str(path), "top1": top1,
                     "against_first": [vars(p) for p in paired_differences(ref_hits, hit1, ok)]})
    return {"held_out_sequences": int(windows.shape[0]), "heads": rows}


def format_comparison(result: dict[str, Any]) -> str:
    """A table a person reads: top-1 by depth, then the paired difference (se) against the first head."""
    lines = [f"held-out sequences: {result['held_out_sequences']}; first head is the reference"]
    for row in result["heads"]:
        top1 = " / ".join(f"{v:.4f}" for v in row["top1"])
        diffs = "  ".join(f"d{p['depth']} {p['difference']:+.4f} ({p['se']:.4f})" for p in row["against_first"])
        lines.append(f"{Path(row['head']).name}: top-1 {top1}\n    paired against the first: {diffs}")
    return "\n".join(lines)
