"""Command-line options and checks that several subcommands share (`rasd generate`, `rasd ask`, ...).

They live below `rasd.cli` so that subcommands defined in their own packages can use them: nothing imports
`rasd.cli`. Failures a person can fix become one-line `CliError`s.
"""

from __future__ import annotations

import argparse
from typing import Any

from rasd.errors import CliError


def _dtype(value: str) -> str:
    """argparse type for --dtype: a clear one-line error for a name torch does not have."""
    from rasd.decoding.model.loading import ModelLoadError, check_dtype

    try:
        return check_dtype(value)
    except ModelLoadError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Model options shared by subcommands."""
    p.add_argument("--model", default="default", help="HF hub id, local path, or `default` (embedded SmolLM2-135M)")
    p.add_argument("--draft-model", default=None,
                   help="small causal LM sharing the target's tokenizer, "
                        "or `eesd` (the target's own early-exit self-draft)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="auto", type=_dtype,
                   help="auto (default: the fastest dtype that is exact on this machine, measured once: bf16 where "
                        "the CPU/GPU computes it natively and it is faster), float32, bfloat16, float16, or int8 / "
                        "int4 (CPU: bf16 activations, weights read as 8 / 4 bits)")
    p.add_argument("--no-graphs", action="store_true",
                   help="on CUDA, verify with eager forwards instead of static shapes captured as CUDA graphs")


def add_sampling_args(p: argparse.ArgumentParser, top_k_flag: str = "--top-k") -> None:
    """Sampling options shared by subcommands; `rasd ask` names top-k `--sample-top-k` (its --top-k retrieves)."""
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument(top_k_flag, dest="sample_top_k", type=int, default=0, help="top-k sampling filter (0 = off)")
    p.add_argument("--seed", type=int, default=None)


def add_repetition_args(p: argparse.ArgumentParser, on: bool) -> None:
    """The repetition stop's flags (`runtime.repetition`): on by default where a person reads the answer (`ask`,
    the batch job), off where a caller expects plain decoding's output (`generate`, as the OpenAI endpoints)."""
    from rasd.decoding.runtime.repetition import DEFAULT_WINDOW

    p.add_argument("--stop-on-repetition", action=argparse.BooleanOptionalAction, default=on,
                   help="end the answer once its newest --repetition-window tokens repeat a span it already holds, "
                        f"dropping that repeat (finish reason `repetition`; default: {'on' if on else 'off'})")
    p.add_argument("--repetition-window", type=int, default=None, metavar="N",
                   help=f"with --stop-on-repetition: tokens that must repeat (default {DEFAULT_WINDOW})")


def repetition_window(args: argparse.Namespace) -> int:
    """The repetition stop's window from the flags (0: off); a ValueError for a window out of range, or one
    given with the stop off (it would be ignored)."""
    from rasd.decoding.runtime.repetition import DEFAULT_WINDOW, check_window

    if args.repetition_window is not None and not args.stop_on_repetition:
        raise ValueError("--repetition-window needs --stop-on-repetition")
    if not args.stop_on_repetition:
        return 0
    window = DEFAULT_WINDOW if args.repetition_window is None else args.repetition_window
    try:
        return check_window(window)
    except ValueError as exc:
        raise ValueError(f"--repetition-window {window}: {exc}") from exc


def repetition_from_args(args: argparse.Namespace) -> int:
    """`repetition_window`, its errors one-line `CliError`s."""
    try:
        return repetition_window(args)
    except ValueError as exc:
        raise CliError(str(exc)) from exc


def sampling_from_args(args: argparse.Namespace) -> Any:
    """SamplingParams from the shared options; invalid values are one-line errors."""
    from rasd.decoding.step.sampling import SamplingParams

    try:
        return SamplingParams(args.temperature, args.top_p, args.sample_top_k, args.seed)
    except ValueError as exc:
        raise CliError(str(exc)) from exc


def load_target(args: argparse.Namespace) -> tuple[Any, Any]:
    """Target and optional draft model, turning load failures into one-line errors."""
    from rasd.decoding.model.loading import ModelLoadError, load_draft, load_model

    try:
        target = load_model(args.model, device=args.device, dtype=args.dtype,
                            graphs=not getattr(args, "no_graphs", False))
        draft = load_draft(args.draft_model, target, getattr(args, "eesd", None))
    except (ModelLoadError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    return target, draft


def check_method(method: str, model: str, draft_model: str | None = None, sizing: str = "cost",
                 eesd: str | None = None, ldlp: str | None = None, eagle: str | None = None) -> None:
    """Fail before loading any model when the method is unknown or lacks what it needs (its `MethodSpec`)."""
    from rasd.decoding.proposers.registry import method_spec

    try:
        method_spec(method).check(model, draft_model, sizing=sizing, eesd=eesd, ldlp=ldlp, eagle=eagle)
    except ValueError as exc:
        raise CliError(str(exc)) from exc


def method_help(default: str) -> str:
    """`--method` help: the registered methods."""
    from rasd.decoding.proposers.registry import METHODS

    return f"decoding method (default {default}): one of {', '.join(METHODS)}"
