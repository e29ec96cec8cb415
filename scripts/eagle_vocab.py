"""How the EAGLE head's draft vocabulary size limits it: for each size N, the share of the target's held-out
greedy tokens inside the N tokens it writes most (a ceiling on top-1 agreement), and a trained head's
held-out top-1 / top-4 by depth when its output is cut to those N rows (no retraining: a lower bound for a
head trained at N). Counts come from the training answers cached by `rasd train eagle --regenerate`.

    python scripts/eagle_vocab.py --head ~/.cache/rasd/eagle-candidates/v4.safetensors --seqs 3872 \
        --sizes 1024,2048,4096,8192 --out docs/results/eagle_vocab.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from rasd.decoding.model.eagle_head import load_head
from rasd.decoding.model.loading import load_model
from rasd.train.common import _prompt_of, generation_cache, prompt_windows
from rasd.train.eagle_head import _rows, depth_agreement, draft_vocabulary, held_out_set, regenerated_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", type=Path, required=True)
    parser.add_argument("--seqs", type=int, default=3872, help="training conversations the counts come from")
    parser.add_argument("--regenerate", type=int, default=192)
    parser.add_argument("--sizes", default="1024,2048,4096,8192")
    parser.add_argument("--eval-seqs", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    target = load_model("default", device="cpu", dtype="float32")
    rows = _rows("builtin")
    counts = regenerated_data(target, rows[: args.seqs], args.regenerate, generation_cache("default"))["counts"]
    eos = set(target.eos_token_ids or ())
    windows = prompt_windows(target.tokenizer, [p for p in (_prompt_of(r) for r in rows[-args.eval_seqs:]) if p], 32)
    seqs, feats, valid = held_out_set(target.model, windows, 48, eos, generation_cache("default"))
    head = load_head(target.model, args.head).float().eval()
    shipped = head.vocab
    answer = seqs[:, windows.shape[1]:][valid[:, windows.shape[1]:]]
    results = []
    for size in [int(s) for s in args.sizes.split(",")] + [len(counts)]:
        vocab = draft_vocabulary(counts, size, eos)
        coverage = 1.0 if vocab is None else float(torch.isin(answer, vocab).float().mean())
        row = {"size": size, "held_out_coverage": round(coverage, 4)}
        if shipped is None or size <= len(shipped):
            keep = vocab if shipped is None or vocab is None else vocab[torch.isin(vocab, shipped)]
            head.set_vocab(keep)
            row.update(depth_agreement(head, seqs, feats, valid, windows.shape[1]))
            row["rows"] = len(keep) if keep is not None else len(counts)
        head.set_vocab(shipped)
        print(json.dumps(row), flush=True)
        results.append(row)
    if args.out:
        args.out.write_text(json.dumps({"head": str(args.head), "seqs": args.seqs, "results": results}, indent=1))


if __name__ == "__main__":
    main()
