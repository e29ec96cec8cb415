"""How fast `eagle` and `rasd` would be with a better head: the shipped head, its logit of the right token raised.

Why: the one bar of #23 left is `rasd` >= 1.3x `pld` on Spec-Bench, and the question behind it is whether a better
head (more training, more layers: GPU work) would meet it, or whether something else binds. This measures it on
this machine: every prompt is first decoded with `pld` (lossless, so that is the target's greedy text); then the
head's logit of the token that text continues with is raised by `boost` wherever a draft node's path follows that
text. The head still runs at its real cost and its tree, pruning and sizing are the product's; only its guesses
get better, and the depth-1 agreement that results is measured in decoding. Every output must still equal
`pld`'s, or the row is flagged.

    python scripts/oracle_head.py --dataset ../shared/data/spec_bench/question.jsonl --skip 5 --limit 2 \
        --boosts 0,1,2,4 --methods eagle,rasd
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm


def path_tokens(parents: Sequence[int], tokens: Sequence[int], node: int) -> list[int]:
    """Tokens from the root's child down to `node` (the root itself excluded)."""
    path = []
    while node > 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def true_next(truth: Sequence[int], context_len: int, path: Sequence[int]) -> int | None:
    """The token the target writes after context + path, when that path follows its text; else None."""
    end = context_len + len(path)
    if end >= len(truth) or list(truth[context_len:end]) != list(path):
        return None
    return truth[end]


class Oracle:
    """Raises a head proposer's logit of the true next token by `boost` (patched onto one proposer instance)."""

    def __init__(self, proposer: Any, boost: float):
        self.proposer, self.boost = proposer, boost
        self.truth: list[int] = []
        self.category = ""                         # the prompt's, set by the caller: counts are kept per category
        self.counts: dict[str, list[int]] = {}     # category -> [depth-1 hits, tries]
        sync, forward_nodes = proposer._sync, proposer._forward_nodes

        def _sync(context: list[int]) -> torch.Tensor | None:
            before = proposer.root_logits
            logits = sync(context)
            if logits is not None and logits is not before:   # a fresh root forward, not the cached one
                self._raise(logits, len(context), [])
                nxt = true_next(self.truth, len(context), [])
                counts = self.counts.setdefault(self.category, [0, 0])
                counts[0] += int(nxt is not None and int(logits.argmax()) == nxt)
                counts[1] += 1
            return logits

        def _forward_nodes(tree: Any, first: int, context_len: int) -> torch.Tensor:
            logits = forward_nodes(tree, first, context_len)
            for row, node in enumerate(range(first, len(tree))):
                self._raise(logits[row], context_len, path_tokens(tree.parents, tree.tokens, node))
            return logits

        proposer._sync, proposer._forward_nodes = _sync, _forward_nodes

    @property
    def hits(self) -> int:
        return sum(h for h, _ in self.counts.values())

    @property
    def tries(self) -> int:
        return sum(t for _, t in self.counts.values())

    def _raise(self, logits: torch.Tensor, context_len: int, path: list[int]) -> None:
        nxt = true_next(self.truth, context_len, path) if self.boost else None
        if nxt is not None:
            logits[nxt] += self.boost


def head_proposer(proposer: Any) -> Any:
    """The EAGLE proposer inside a method's proposer (`eagle` itself, `rasd`'s drafter); a method without one is
    refused (there is no head to make better)."""
    found = getattr(proposer, "draft", None) or proposer
    if not getattr(found, "wants_hidden", False):
        raise SystemExit(f"oracle_head: method {getattr(proposer, 'name', proposer)!r} drafts with no EAGLE head")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--skip", type=int, default=5, help="rows of each category to leave out first")
    parser.add_argument("--limit", type=int, default=2, help="rows of each category after the skipped ones")
    parser.add_argument("--methods", default="eagle,rasd")
    parser.add_argument("--boosts", default="0,1,2,4")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()

    from rasd.decoding.model.loading import load_model
    from rasd.eval.datasets import load_items, prepare_prompts
    from rasd.eval.runners import EngineRunner, SamplingConfig

    target = load_model("default")
    items = load_items(args.dataset, None, args.skip + args.limit)
    per_category: dict[str, int] = {}
    kept = []
    for item in items:
        seen = per_category.get(item.category, 0)
        per_category[item.category] = seen + 1
        if seen >= args.skip:
            kept.append(item)
    prompts = prepare_prompts(kept, target.tokenizer, 2048)
    boosts = [float(b) for b in args.boosts.split(",")]
    names = ["pld"] + [f"{m}@{b:g}" for m in args.methods.split(",") for b in boosts]
    runners, oracles = {}, {}
    for name in names:
        method, _, boost = name.partition("@")
        runners[name] = EngineRunner(method, target, SamplingConfig())
        if boost:
            oracles[name] = Oracle(head_proposer(runners[name].decoder.proposer), float(boost))
    for runner in runners.values():
        runner.prepare(prompts, args.max_new_tokens)
        runner.decoder.generate(prompts[0].input_ids[:64], 8)   # warm-up, untimed
        runner.after_warmup()
    for oracle in oracles.values():
        oracle.counts.clear()   # the warm-up's tries had no text to be right about
    speed: dict[str, list[float]] = {n: [] for n in names}
    accepted: dict[str, list[float]] = {n: [] for n in names}
    mismatches = 0
    for i, prompt in enumerate(tqdm(prompts, desc="prompts")):
        order = names[i % len(names):] + names[: i % len(names)]
        truth = None
        for name in ["pld"] + [n for n in order if n != "pld"]:
            runner = runners[name]
            runner.bind(prompt)
            if name in oracles:
                oracles[name].truth, oracles[name].category = truth, prompt.item.category
            record = runner.run(prompt.input_ids, args.max_new_tokens, None)
            if truth is None:
                truth = list(prompt.input_ids) + record.token_ids
            elif list(prompt.input_ids) + record.token_ids != truth:
                mismatches += 1
            speed[name].append(record.tokens_per_s or 0.0)
            accepted[name].append(record.mean_accepted_tokens or 0.0)
    _report(names, speed, accepted, oracles, mismatches)
    if oracles:
        first, oracle = next(iter(oracles.items()))
        print(f"{first}: depth-1 agreement by category: " + ", ".join(
            f"{c} {h / t:.2f}" for c, (h, t) in sorted(oracle.counts.items()) if t))


def _report(names: list[str], speed: dict[str, list[float]], accepted: dict[str, list[float]],
            oracles: dict[str, Oracle], mismatches: int) -> None:
    """Per variant: depth-1 agreement in decoding, mean tok/s, median ratio to `pld`, mean accepted."""
    print(f"{'variant':12}{'depth-1 agree':>15}{'tok/s':>9}{'x pld (median)':>16}{'x pld (mean)':>14}{'accepted':>10}")
    base = speed["pld"]
    for name in names:
        oracle = oracles.get(name)
        agree = f"{oracle.hits / oracle.tries:.3f}" if oracle and oracle.tries else "-"
        ratios = [s / b for s, b in zip(speed[name], base, strict=True) if b > 0]
        mean = statistics.fmean(speed[name]) / statistics.fmean(base)
        print(f"{name:12}{agree:>15}{statistics.fmean(speed[name]):9.2f}{statistics.median(ratios):16.3f}"
              f"{mean:14.3f}{statistics.fmean(accepted[name]):10.2f}")
    print(f"outputs different from pld's: {mismatches}")


if __name__ == "__main__":
    main()
