"""Which features should the EAGLE head read: the target's final features alone (EAGLE-1/2) or low and mid
layers fused beside them (EAGLE-3)? Two heads trained side by side from the same start, on the same
conversations, steps, seed and draft vocabulary; held-out top-1 / top-4 agreement by depth 1-4 for each.

The fused head starts as the plain one (its tapped layers weigh zero), so any difference is what the taps
teach it. Text: ShareGPT conversations as they are (one target forward per sequence: the cheap data), or with
`--selfgen N` the target's own answers in the first N cached chunks of `rasd train eagle --regenerate` (the
shipped head's kind of data; their features are recomputed by the fp32 target with the taps). `--init PATH`
starts both arms from a trained head (the fused arm: its weights, taps weighing zero), so the question is
asked at the shipped head's scale, not from scratch. The same 128 held-out prompts `rasd train eagle`
evaluates on.

    python scripts/eagle_layers_ab.py --seqs 512 --steps 150 --taps 2,15 \
        --out docs/results/eagle_layers_ab.json
    python scripts/eagle_layers_ab.py --init rasd/decoding/model/heads/smollm2-135m-instruct.safetensors \
        --selfgen 8 --steps 600 --lr 1e-3 --out docs/results/eagle_layers_ab_v12.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from rasd.decoding.model.eagle_head import load_head, save_head
from rasd.decoding.model.loading import load_model
from rasd.train.common import generation_cache
from rasd.train.eagle_head import (
    _rows,
    _start_head,
    conversation_ids,
    depth_agreement,
    draft_vocabulary,
    extract_features,
    held_out_set,
    held_out_split,
    held_out_windows,
    train_head,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=512, help="training conversations (the first ones)")
    parser.add_argument("--seq-len", type=int, default=384)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--taps", default="2,15", help="target layers fused beside the final features")
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--eval-seqs", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init", type=Path, default=None, help="start both arms from this trained head")
    parser.add_argument("--selfgen", type=int, default=0,
                        help="train on the own answers of the first N cached selfgen chunks, not ShareGPT")
    parser.add_argument("--arms", default="final,fused", help="which heads to train: final, fused or both")
    parser.add_argument("--features", type=Path, default=None,
                        help="keep the computed features in shards here (a second run reads them back)")
    parser.add_argument("--save", type=Path, default=None, help="write each trained arm here (<arm>.safetensors)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    taps = tuple(int(t) for t in args.taps.split(","))

    target = load_model("default", dtype="float32")
    rows = _rows("builtin")
    rest, eval_rows = held_out_split(rows, args.eval_seqs)
    train_rows = rest[: args.seqs]
    t0 = time.perf_counter()
    texts = (own_answers(args.selfgen) if args.selfgen
             else conversation_ids(target.tokenizer, train_rows, args.seq_len))
    data = extract_features(target.model, texts, args.features, taps=taps)
    features_s = time.perf_counter() - t0
    eos = set(target.eos_token_ids or ())
    vocab = (load_head(target.model, args.init).vocab if args.init
             else draft_vocabulary(data["counts"], args.draft_vocab, eos))
    windows = held_out_windows(target.tokenizer, eval_rows)
    seqs, feats, valid = held_out_set(target.model, windows, 48, eos, generation_cache("default"), taps=taps)
    hidden = target.model.config.hidden_size
    arms = {"final": ((), hidden), "fused": (taps, feats.shape[-1])}
    arms = {name: arm for name, arm in arms.items() if name in args.arms.split(",")}
    result = {"model": "default", "train_sequences": len(data["tokens"]),
              "train_tokens": sum(len(s) for s in data["tokens"]), "steps": args.steps, "lr": args.lr,
              "seed": args.seed, "ttt": True, "init": str(args.init) if args.init else None,
              "text": f"own answers, {args.selfgen} selfgen chunks" if args.selfgen else "ShareGPT as is",
              "draft_vocab": args.draft_vocab, "features_s": round(features_s, 1),
              "torch_threads": torch.get_num_threads(), "arms": {}}
    for name, (arm_taps, width) in arms.items():
        torch.manual_seed(args.seed)
        head = _start_head(target.model, vocab, args.init, arm_taps)   # a fused arm starts as `init` exactly
        before = depth_agreement(head.eval(), seqs, feats[..., -width:], valid, windows.shape[1])
        t1 = time.perf_counter()
        final = train_head(head, data["tokens"], [f[:, -width:] for f in data["feats"]], args.steps, lr=args.lr,
                           seed=args.seed, ttt=True)
        result["arms"][name] = {"taps": list(arm_taps), "train_s": round(time.perf_counter() - t1, 1),
                                "final_train": final, "agreement_before": before,
                                "agreement": depth_agreement(head, seqs, feats[..., -width:], valid, windows.shape[1])}
        print(name, result["arms"][name]["agreement"], flush=True)
        if args.save is not None:
            save_head(args.save / f"{name}.safetensors", head, {**result["arms"][name], "init": result["init"],
                                                                "text": result["text"], "steps": args.steps})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


def own_answers(chunks: int) -> list[list[int]]:
    """The token ids of the answers in the first `chunks` cached selfgen chunk files (oldest first)."""
    files = sorted(generation_cache("default").glob("*-features.pt"), key=lambda f: f.stat().st_mtime)
    if len(files) < chunks:
        raise SystemExit(f"--selfgen {chunks}: only {len(files)} cached chunks under {generation_cache('default')}")
    return [list(t) for f in files[:chunks] for t in torch.load(f)["tokens"]]


if __name__ == "__main__":
    main()
