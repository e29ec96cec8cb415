"""Where each method's decode time goes, per request, on LongBench docqa or Spec-Bench rows (interleaved).

Why: `rasd bench` reports tokens/s and accepted tokens; when a method accepts more tokens a step than another
and is still slower, this says whether drafting, verification or bookkeeping took the difference.

    python bench/step_breakdown.py --dataset ../shared/data/longbench/longbench_dev.jsonl --task docqa \
        --limit 5 --methods pld,rasd,rasd:head=off
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from tqdm import tqdm


def breakdown(stats: Any) -> dict[str, float]:
    """Per-request decode timings (ms) and counts from one generation's `DecodeStats`."""
    decode_s = stats.total_time_s - stats.prefill_time_s
    steps = max(stats.steps, 1)
    return {"tok/s": (stats.new_tokens - 1) / decode_s if decode_s > 0 else 0.0,
            "steps": stats.steps, "accepted": stats.mean_accepted_tokens,
            "draft ms/step": 1e3 * stats.draft_time_s / steps, "verify ms/step": 1e3 * stats.verify_time_s / steps,
            "bookkeeping ms/step": 1e3 * stats.bookkeeping_time_s / steps,
            "tree tokens/step": 1 + stats.num_draft_tokens / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--task", default=None, help="docqa: LongBench QA rows with their retrieval scope")
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--category", action="append", default=None, help="keep only this category; repeatable")
    parser.add_argument("--methods", default="pld,rasd")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()

    from rasd.decoding.model.loading import load_model
    from rasd.eval.runners import EngineRunner, SamplingConfig

    target = load_model("default")
    prompts = _prompts(args, target)
    runners = [EngineRunner(name, target, SamplingConfig()) for name in args.methods.split(",")]
    for runner in runners:
        runner.prepare(prompts, args.max_new_tokens)
        runner.decoder.generate(prompts[0].input_ids[:64], 8)        # warm-up, untimed
    rows: dict[str, list[dict[str, float]]] = {r.name: [] for r in runners}
    for i, prompt in enumerate(tqdm(prompts, desc="rows")):
        for runner in runners[i % len(runners):] + runners[: i % len(runners)]:
            runner.bind(prompt)
            out = runner.decoder.generate(prompt.input_ids, args.max_new_tokens, eos_token_ids=runner.eos_ids)
            rows[runner.name].append(breakdown(out.stats))
    keys = list(next(iter(rows.values()))[0])
    print(f"{'method (median over rows)':28}" + "".join(f"{k:>20}" for k in keys))
    for name, records in rows.items():
        print(f"{name:28}" + "".join(f"{statistics.median(r[k] for r in records):20.2f}" for k in keys))


def _prompts(args: argparse.Namespace, target: Any) -> list[Any]:
    if args.task == "docqa":
        from rasd.eval.bench_docqa import prepare_docqa_prompts

        return prepare_docqa_prompts(args.dataset, args.category, args.limit, target, args.max_new_tokens, 4,
                                     lambda _: None)
    from rasd.eval.datasets import load_items, prepare_prompts

    return prepare_prompts(load_items(args.dataset, args.category, args.limit), target.tokenizer, 2048)


if __name__ == "__main__":
    main()
