"""What one EAGLE-head draft forward costs against one target step on this machine, as decoding runs them.

A head forward over a frontier of n tree nodes (the layer, the draft LM head over the draft vocabulary's rows,
softmax and top-k) is timed between target steps, so the head's weights are as cold as in decoding (the target
streams its 540 MB of weights every step; a warm micro-benchmark of the head alone runs several times faster on
a memory-bound host). Draft vocabularies smaller than the shipped head's are timed with its first N rows: the
cost of N rows, not a trained N-row head's agreement. Medians over interleaved repetitions.

    python bench/head_cost.py --context 256 --reps 30 --rows 8192,4096,2048 \
        --out docs/results/head_cost_<date>.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from rasd.decoding.model import fast_forward
from rasd.decoding.model.eagle_head import EagleHead, shared_head
from rasd.decoding.model.kernels import fast_kernels, install
from rasd.decoding.model.loading import load_model
from rasd.decoding.step.cache import GrowableLayer, TreeCache


def target_step(model: torch.nn.Module, cache: TreeCache, token: int, position: int) -> float:
    """Seconds of one plain decoding step at `position` (its cache entry is dropped afterwards)."""
    t0 = time.perf_counter()
    fast_forward.forward(model, cache, torch.tensor([[token]]), torch.tensor([[position]]), last_only=True)
    elapsed = time.perf_counter() - t0
    cache.crop(-1)
    return elapsed


def head_step(head: EagleHead, kv: GrowableLayer, feats: torch.Tensor, ids: torch.Tensor, position: int) -> float:
    """Seconds of one head forward over a frontier of n = len(ids) sibling nodes at `position`, with the
    top-k over the draft rows a tree layer takes (its cache entries are dropped afterwards)."""
    n, past = len(ids), kv.get_seq_length()
    mask = torch.zeros(1, 1, n, past + n)
    mask[0, 0, :, past:] = torch.finfo(mask.dtype).min
    mask[0, 0, :, past:].fill_diagonal_(0.0)                       # each node sees the context and itself
    t0 = time.perf_counter()
    predicted = head(feats[None].expand(1, n, -1), ids[None], torch.full((1, n), position), kv=kv, mask=mask)
    head.logits(predicted[0]).float().softmax(-1).topk(8, dim=-1)
    elapsed = time.perf_counter() - t0
    kv.crop(-n)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rows", default="8192,2048", help="draft-vocabulary sizes to time (<= the head's)")
    parser.add_argument("--nodes", default="1,4,8", help="frontier sizes to time")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    loaded = load_model("default")
    model = install(loaded.model.eval())
    head = shared_head(model, None, "default")
    full_vocab = head.vocab
    ids = torch.randint(100, 10_000, (1, args.context))
    cache, kv = TreeCache.for_model(model), GrowableLayer()
    with torch.inference_mode(), fast_kernels():
        hidden = model(ids, output_hidden_states=True).hidden_states[-1][0]        # [T, H], after the final norm
        fast_forward.forward(model, cache, ids[:, :-1], torch.arange(args.context - 1)[None])
        head(hidden[None, :-2], ids[:, 1:-1], torch.arange(1, args.context - 1)[None], kv=kv)
        rows = [int(r) for r in args.rows.split(",")]
        nodes = [int(n) for n in args.nodes.split(",")]
        times: dict[str, list[float]] = {"target": []}
        last, position = int(ids[0, -1]), args.context - 1
        for _ in tqdm(range(args.reps), desc="timing", unit="rep"):
            for n_rows in rows:
                head.set_vocab(full_vocab[:n_rows] if full_vocab is not None and n_rows < len(full_vocab) else
                               full_vocab)
                for n in nodes:
                    times["target"].append(target_step(model, cache, last, position))
                    sample = head_step(head, kv, hidden[-2], torch.randint(100, 10_000, (n,)), position)
                    times.setdefault(f"head rows={n_rows} nodes={n}", []).append(sample)
        head.set_vocab(full_vocab)
    target_ms = statistics.median(times["target"]) * 1e3
    report = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "context": args.context, "reps": args.reps, "target_step_ms": round(target_ms, 2), "head": {}}
    print(f"target step: {target_ms:.2f} ms (median of {len(times['target'])})")
    for key, samples in times.items():
        if key == "target":
            continue
        ms = statistics.median(samples) * 1e3
        n = int(key.rsplit("=", 1)[1])
        report["head"][key] = {"ms": round(ms, 2), "vs_target_step": round(ms / target_ms, 3),
                               "ms_per_draft_token": round(ms / n, 2)}
        print(f"{key:28s} {ms:7.2f} ms  {ms / target_ms:6.3f} of a target step  {ms / n:6.2f} ms per draft token")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
