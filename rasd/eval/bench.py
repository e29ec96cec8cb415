"""`rasd bench`: speed and exactness of every decoding method on Spec-Bench / LongBench prompts.

Why it is built the way it is:
- Every method decodes the *same* token ids (chat template applied once, same EOS set, same
  `max_new_tokens`), so greedy outputs can be compared token for token with Hugging Face `generate`.
- Methods run interleaved prompt by prompt (their order rotating) after one untimed warm-up each, so that
  drift of a noisy shared machine (thermal, other tenants) hits all methods alike.
- Speed is the decode phase: tokens after the first new one over the time after it arrived. Prefill cost
  is the same for every method and would otherwise hide the speculation's effect; `e2e_tokens_per_s`
  beside it includes prefill. For HF the first token's arrival is taken from a streamer.
- Totals (sum of tokens / sum of time) are the headline; per-prompt medians are kept as well because a
  single slow prompt on a noisy machine can move a ratio of sums.
- A looping answer is decoded almost for free by copy-based drafting, so every speedup is also given on the
  answers that do not loop (`looping`); `--stop-on-repetition` ends loops in every method and baseline alike.
- On LongBench rows the reference answers are scored with LongBench's own metrics (`quality`) once per run: all
  lossless methods give the same answer, so quality belongs to the model, prompt and retrieval, not the method.

Data files are read where they are (e.g. `../shared/data`), never copied.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rasd.cli_options import add_repetition_args, repetition_window
from rasd.eval.aggregate import build_results
from rasd.eval.bench_output import format_table, plot_speedups, write_answers, write_results
from rasd.eval.datasets import BenchItem, BenchPrompt, load_items, prepare_prompts
from rasd.eval.quality import format_quality, quality_section
from rasd.eval.runners import LLAMACPP, Runner, RunRecord, SamplingConfig, make_runner, run_prompts, split_dtype

if TYPE_CHECKING:
    from rasd.decoding.model.loading import LoadedModel


DEFAULT_METHODS = "ar,hf,hf-pld,pld"

@dataclass
class BenchConfig:
    """Everything a benchmark run needs besides the models and the prompts."""

    methods: list[str]
    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    warmup: bool = True
    progress: bool = True
    gguf: Path | None = None     # the file `llamacpp` runs (None: the embedded model's own, for `default`)
    repetition: int = 0          # the repetition stop's window for every method and baseline (0: off)


def run_benchmark(target: LoadedModel, prompts: Sequence[BenchPrompt], config: BenchConfig,
                  draft: LoadedModel | None = None, meta: dict[str, Any] | None = None,
                  ) -> tuple[dict[str, Any], list[RunRecord]]:
    """Build the runners, run them interleaved, and aggregate: the in-process entry point tests use."""
    import torch

    runners = [_runner(name, target, config, draft) for name in config.methods]
    records = run_prompts(runners, prompts, config.max_new_tokens, config.sampling, config.warmup,
                          config.progress)
    base_meta = {"model": target.name, "device": target.device, "dtype": target.dtype,
                 "verify_path": target.step.label,
                 "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                 "torch_threads": torch.get_num_threads(), "max_new_tokens": config.max_new_tokens,
                 "draft_model": draft.name if draft is not None else None,
                 "temperature": config.sampling.temperature, "top_p": config.sampling.top_p,
                 "top_k": config.sampling.top_k, "seed": config.sampling.seed, "num_prompts": len(prompts),
                 "repetition_window": config.repetition or None}
    for runner in runners:
        base_meta.update(getattr(runner, "meta", {}))
    base_meta.update(meta or {})
    results = build_results(base_meta, records, config.methods, config.sampling.greedy)
    results["cost_curves"] = _used_curves(runners)
    results["quality"] = quality_section(prompts, records, results["looping"]["reference"], target.tokenizer)
    if LLAMACPP in config.methods and results["greedy_reference"] not in (None, LLAMACPP):
        from rasd.eval.llamacpp import first_differences

        results["llamacpp_first_difference"] = first_differences(records, results["greedy_reference"])
    return results, records


def _runner(name: str, target: LoadedModel, config: BenchConfig, draft: LoadedModel | None) -> Runner:
    """`llamacpp` on its GGUF file with torch's thread count (`--threads`), every other method by `make_runner`."""
    if name != LLAMACPP:
        return make_runner(name, target, config.sampling, draft, config.repetition)
    import torch

    from rasd.eval.llamacpp import LlamaCppRunner, resolve_gguf

    gguf = config.gguf or resolve_gguf(target.name, None)
    vocab = getattr(target.model.config, "vocab_size", None)
    return LlamaCppRunner(gguf, config.sampling, target.eos_token_ids, torch.get_num_threads(),
                          gpu=str(target.device).startswith("cuda"), vocab_size=vocab, repetition=config.repetition)


def _used_curves(runners: Sequence[Runner]) -> list[dict[str, Any]]:
    """The measured cost curves the runners' sizers used, once each, with the methods that used them."""
    curves: dict[str, dict[str, Any]] = {}
    for runner in runners:
        for key, curve in getattr(runner, "curves", {}).items():
            entry = curves.setdefault(key, {"key": key, "context_len": curve.context_len,
                                            "sizes": list(curve.sizes), "latency_s": list(curve.latency_s),
                                            "methods": []})
            entry["methods"].append(runner.name)
    return sorted(curves.values(), key=lambda c: c["context_len"])


def parse_methods(text: str) -> list[str]:
    """`ar,hf,pld` → ['ar', 'hf', 'pld'], duplicates removed, order kept."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise ValueError("--methods is empty")
    return list(dict.fromkeys(names))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench options, shared by `rasd bench` and `python -m rasd.eval.bench`."""
    parser.add_argument("--model", default="default", help="hub id, local path, or 'default' (embedded)")
    parser.add_argument("--draft-model", default=None,
                        help="draft model for `draft`, `optree`, `rasd`, `hf-assisted`; `eesd` = the target's "
                             "early-exit self-draft (`optree` uses it by default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="auto (the fastest exact dtype on this machine, measured "
                        "once), float32, bfloat16 or float16; HF baselines run in the same dtype")
    parser.add_argument("--no-graphs", action="store_true",
                        help="on CUDA, verify with eager forwards instead of static shapes in CUDA graphs")
    parser.add_argument("--dataset", required=True, help="Spec-Bench question.jsonl or LongBench jsonl")
    parser.add_argument("--task", choices=("generate", "docqa"), default="generate",
                        help="docqa: index each LongBench row's context and ask its question through retrieval")
    parser.add_argument("--index", default=None,
                        help="datastore index for the retrieval methods on every prompt (`rasd index build`)")
    parser.add_argument("--retrieve-k", type=int, default=4, help="docqa: chunks retrieved into the prompt")
    parser.add_argument("--category", action="append", default=None,
                        help="keep only this category (or LongBench dataset); repeatable")
    parser.add_argument("--methods", default=DEFAULT_METHODS,
                        help=f"comma list (default {DEFAULT_METHODS}); METHOD:KEY=VALUE runs a method with an "
                             "option changed beside the plain one, e.g. rasd:history=off; METHOD:dtype=D runs it on "
                             "the target in dtype D, e.g. rasd:dtype=float32 beside rasd in the auto dtype")
    parser.add_argument("--limit", type=int, default=None, help="prompts per category")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="prompt budget (default: model context minus --max-new-tokens)")
    parser.add_argument("--long-prompts", choices=("truncate", "skip"), default="truncate",
                        help="what to do with prompts over the budget")
    parser.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (llamacpp: its threads)")
    parser.add_argument("--gguf", default=None, metavar="PATH",
                        help="the GGUF file the llamacpp baseline runs (default: the embedded model's own, for "
                             "--model default; required for any other --model)")
    add_repetition_args(parser, on=False)   # every method and baseline alike: the engine's `repetition` rule
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up generation")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--out", default=None, help="write results.json here")
    parser.add_argument("--plot", default=None, help="write a PNG of speedups here")
    parser.add_argument("--answers", default=None, help="write Spec-Bench-style answers JSONL here")
    parser.add_argument("--report", default=None, metavar="DIR",
                        help="write a report (report.md, report.html, PNG plots) into this folder")


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `bench` subcommand; its handler is `args.func(args) -> exit code`."""
    parser = subparsers.add_parser("bench", help="benchmark decoding methods on Spec-Bench / LongBench",
                                   description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.set_defaults(func=run_from_args)
    return parser


def _validate(args: argparse.Namespace, methods: list[str]) -> None:
    """Bad argument combinations fail before any model is loaded."""
    if args.max_new_tokens <= 0:
        raise ValueError("--max-new-tokens must be positive")
    if args.limit is not None and args.limit <= 0:
        raise ValueError("--limit must be positive")
    if "hf-assisted" in methods and not args.draft_model:
        raise ValueError("method hf-assisted needs --draft-model")
    if args.temperature < 0:
        raise ValueError("--temperature must be >= 0")
    repetition_window(args)
    from rasd.decoding.model.loading import check_dtype
    from rasd.decoding.proposers.registry import METHODS, method_variant
    from rasd.eval.runners import BASELINES, HF_METHODS

    for full in methods:   # a misspelt method, option key or value fails now, not after the model has loaded
        if full.partition(":")[0] == LLAMACPP:
            from rasd.eval.llamacpp import check_method

            check_method(full)
            continue
        name, dtype = split_dtype(full)
        if dtype is not None:
            check_dtype(dtype)
        if name not in HF_METHODS:
            try:
                method_variant(name)
            except ValueError as exc:
                hint = f" (or a baseline: {', '.join(BASELINES)})" if name.partition(":")[0] not in METHODS else ""
                raise ValueError(f"{exc}{hint}") from exc


def _llamacpp_gguf(args: argparse.Namespace, methods: list[str]) -> Path | None:
    """The GGUF for `llamacpp`, checked with the arguments: the file first, then that llama-cpp-python imports."""
    if LLAMACPP not in methods:
        return None
    from rasd.eval.llamacpp import require_llama_cpp, resolve_gguf

    gguf = resolve_gguf(args.model, args.gguf)
    require_llama_cpp()
    return gguf


def run_from_args(args: argparse.Namespace) -> int:
    """Load data and models, run, print the table and write the requested files."""
    import torch

    from rasd.decoding.model.loading import ModelLoadError, load_draft, load_model
    from rasd.errors import CliError

    try:   # bad arguments, a missing dataset or model: one line, before any decoding
        methods = parse_methods(args.methods)
        _validate(args, methods)
        gguf = _llamacpp_gguf(args, methods)
        if args.threads:
            torch.set_num_threads(args.threads)
        items = load_items(args.dataset, args.category, args.limit) if args.task == "generate" else []
        target = load_model(args.model, device=args.device, dtype=args.dtype, graphs=not args.no_graphs)
        draft = load_draft(args.draft_model, target, getattr(args, "eesd", None))
        prompts = _prompts(args, items, target)
    except (ValueError, OSError, ModelLoadError) as exc:
        raise CliError(str(exc)) from exc
    if not prompts:
        raise CliError("every prompt was skipped")
    sampling = SamplingConfig(args.temperature, args.top_p, args.top_k, args.seed)
    config = BenchConfig(methods, args.max_new_tokens, sampling, not args.no_warmup, not args.no_progress, gguf,
                         repetition_window(args))
    meta = {"dataset": str(args.dataset), "task": args.task, "index": args.index, "categories": args.category,
            "limit": args.limit, "truncated_prompts": sum(p.truncated_tokens > 0 for p in prompts),
            "skipped_prompts": max(len(items) - len(prompts), 0)}
    results, records = run_benchmark(target, prompts, config, draft, meta)
    print(format_table(results))
    print(format_quality(results["quality"]))
    if results.get("llamacpp_first_difference") is not None:
        from rasd.eval.llamacpp import format_first_differences

        print(format_first_differences(results["llamacpp_first_difference"], results["greedy_reference"]))
    if "hf" in methods and sampling.temperature == 0:
        from rasd.eval.near_ties import divergences, format_divergences

        results["divergences_from_hf"] = divergences(target.model, prompts, records)
        apart = [m for m in methods if m == LLAMACPP or split_dtype(m)[1] is not None]
        print(format_divergences(results["divergences_from_hf"], apart=apart))
    _write_outputs(args, results, records, target)
    return 0


def _prompts(args: argparse.Namespace, items: list[BenchItem], target: LoadedModel) -> list[BenchPrompt]:
    """Tokenised prompts for the task; with --index every prompt drafts from that datastore too."""
    if args.task == "docqa":
        from rasd.eval.bench_docqa import prepare_docqa_prompts

        return prepare_docqa_prompts(args.dataset, args.category, args.limit, target, args.max_new_tokens,
                                     args.retrieve_k, _log)
    budget = args.max_prompt_tokens or (target.max_context - args.max_new_tokens)
    prompts = prepare_prompts(items, target.tokenizer, budget, args.long_prompts, not args.no_chat, _log)
    if args.index:
        from rasd.eval.bench_docqa import RetrievalScope
        from rasd.index.store import Index, check_tokenizer

        index = Index.open(args.index)
        check_tokenizer(index, target)
        for prompt in prompts:
            prompt.scope = RetrievalScope(index.datastores(), [])
    return prompts


def _log(message: str) -> None:
    """Progress notes go to stderr so stdout holds only the table."""
    print(message, file=sys.stderr)


def _write_outputs(args: argparse.Namespace, results: dict[str, Any], records: Sequence[RunRecord],
                   target: LoadedModel) -> None:
    if args.out:
        write_results(args.out, results)
        print(f"results: {args.out}", file=sys.stderr)
    if args.answers:
        write_answers(args.answers, records, target.tokenizer, target.name)
        print(f"answers: {args.answers}", file=sys.stderr)
    if args.plot:
        plot_speedups(results, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    if getattr(args, "report", None):
        from rasd.eval.report import write_report

        write_report(results, args.report)
        print(f"report: {Path(args.report) / 'report.md'}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m rasd.eval.bench ...`: the same as `rasd bench ...`."""
    parser = argparse.ArgumentParser(prog="rasd bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    from rasd.decoding.model.loading import ModelLoadError
    from rasd.errors import CliError

    try:
        return run_from_args(args)
    except (CliError, ValueError, FileNotFoundError, ModelLoadError) as exc:
        print(f"rasd bench: error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
