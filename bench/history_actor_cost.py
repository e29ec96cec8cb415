"""What a response history shared by replicas would cost per drafting step: one lookup in-process against
the same lookup as a call on a Ray actor holding the store (the per-replica store the service uses costs
only the former). Prints medians in ms; run on a quiet machine:

    python bench/history_actor_cost.py --answers 256 --calls 300
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import ray

from rasd.decoding.drafting.history import ResponseHistory


def filled_store(answers: int, length: int, seed: int) -> tuple[ResponseHistory, list[list[int]]]:
    """A store of `answers` random answers of `length` tokens behind 32-token prompt tails."""
    rng = random.Random(seed)
    store, seqs = ResponseHistory(max_mb=64), []
    for _ in range(answers):
        tail, answer = [rng.randrange(150_000) for _ in range(32)], [rng.randrange(150_000) for _ in range(length)]
        store.add(tail, answer)
        seqs.append(tail + answer)
    return store, seqs


def contexts(seqs: list[list[int]], calls: int, seed: int) -> list[list[int]]:
    """Decoding contexts that end inside stored answers (what a repeated question looks like mid-answer)."""
    rng = random.Random(seed + 1)
    out = []
    for _ in range(calls):
        seq = rng.choice(seqs)
        cut = rng.randrange(33, len(seq))
        out.append([rng.randrange(150_000) for _ in range(800)] + seq[:cut])
    return out


@ray.remote(num_cpus=0)
class HistoryActor:
    """The store in its own process, as a shared `history` would be."""

    def __init__(self, answers: int, length: int, seed: int):
        self.store, _ = filled_store(answers, length, seed)

    def lookup(self, tail: list[int]) -> tuple[int, int]:
        match = self.store.lookup(tail, 32, 16)
        return match.length, len(match.continuations)


def timed(fn, items: list[list[int]]) -> list[float]:
    times = []
    for item in items:
        start = time.perf_counter()
        fn(item)
        times.append(1000 * (time.perf_counter() - start))
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--answers", type=int, default=256)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    store, seqs = filled_store(args.answers, args.length, args.seed)
    items = contexts(seqs, args.calls, args.seed)
    local = timed(lambda c: store.lookup(c, 32, 16), items)
    ray.init(include_dashboard=False, log_to_driver=False)
    actor = HistoryActor.remote(args.answers, args.length, args.seed)
    ray.get(actor.lookup.remote(items[0][-24:]))
    # only the context's last max_match (24) tokens need to cross: the store never matches longer
    remote = timed(lambda c: ray.get(actor.lookup.remote(c[-24:])), items)
    assert all(store.lookup(c, 32, 16).length == ray.get(actor.lookup.remote(c[-24:]))[0] for c in items[:20])
    print(f"{args.answers} answers of {args.length} tokens, {args.calls} lookups")
    for name, times in (("in-process lookup", local), ("Ray actor lookup ", remote)):
        print(f"{name}: median {statistics.median(times):.3f} ms, p90 {sorted(times)[int(0.9 * len(times))]:.3f} ms")
    ray.shutdown()


if __name__ == "__main__":
    main()
