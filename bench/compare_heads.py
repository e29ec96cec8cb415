"""Compare EAGLE heads for one target position by position on `rasd train eagle`'s held-out text.

Why: a head's held-out agreement alone has a standard error about as large as what a new draw of training
text adds; the paired difference against a reference head (`rasd.train.head_compare`) tells them apart.

    python bench/compare_heads.py REFERENCE.safetensors CANDIDATE.safetensors [MORE ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from rasd.decoding.model.loading import load_model
    from rasd.train.head_compare import compare_heads, format_comparison

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("heads", nargs="+", type=Path, help="head files; the first is the reference")
    p.add_argument("--model", default="default", help="the target the heads draft for")
    p.add_argument("--data", default="builtin", help="the --data the heads were trained with (its held-out rows)")
    p.add_argument("--eval-seqs", type=int, default=128, help="the --eval-seqs of `rasd train eagle`")
    p.add_argument("--json", type=Path, default=None, help="also write the comparison here")
    args = p.parse_args(argv)
    missing = [str(h) for h in args.heads if not h.exists()]
    if missing:
        print(f"compare_heads: no head file at {', '.join(missing)}", file=sys.stderr)
        return 2
    target = load_model(args.model, dtype="float32")
    result = compare_heads(target, args.heads, args.data, args.eval_seqs, args.model)
    print(format_comparison(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
