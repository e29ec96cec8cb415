"""The `rasd` command: `rasd generate`, `rasd bench`, `rasd train {eesd,ldlp}` and the service commands.

Errors a person can fix (unknown method, missing model, empty or too-long prompt) print one line on stderr
and exit with status 2; nothing else is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from rasd.decoding.control import SIZINGS
from rasd.decoding.proposers import METHODS


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    """All subcommands; `bench` lives with its pipeline."""
    parser = argparse.ArgumentParser(prog="rasd", description="Lossless retrieval-augmented speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    from rasd.index import cli as index_cli
    from rasd.pipelines import bench, docqa, fault, load, serve_cli

    bench.register(sub)
    index_cli.register(sub)
    docqa.register(sub)
    serve_cli.register(sub)
    load.register(sub)
    fault.register(sub)
    _add_train(sub)
    return parser


def _add_train(sub: Any) -> None:
    """`rasd train {eesd,ldlp}`: the learned parts of the self-draft and of AdaEAGLE's length predictor."""
    from rasd.train import eesd, ldlp

    p = sub.add_parser("train", help="train EESD's exit layer or AdaEAGLE's draft length predictor")
    what = p.add_subparsers(dest="what", required=True)
    eesd.add_parser(what)
    ldlp.add_parser(what)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Model options shared by subcommands."""
    p.add_argument("--model", default="default", help="HF hub id, local path, or `default` (embedded SmolLM2-135M)")
    p.add_argument("--draft-model", default=None,
                   help="small causal LM sharing the target's tokenizer, "
                        "or `eesd` (the target's own early-exit self-draft)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")


def add_sampling_args(p: argparse.ArgumentParser, top_k_flag: str = "--top-k") -> None:
    """Sampling options shared by subcommands; `rasd ask` names top-k `--sample-top-k` (its --top-k retrieves)."""
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument(top_k_flag, dest="sample_top_k", type=int, default=0, help="top-k sampling filter (0 = off)")
    p.add_argument("--seed", type=int, default=None)


def sampling_from_args(args: argparse.Namespace) -> Any:
    """SamplingParams from the shared options; invalid values are one-line errors."""
    from rasd.decoding.sampling import SamplingParams

    try:
        return SamplingParams(args.temperature, args.top_p, args.sample_top_k, args.seed)
    except ValueError as exc:
        raise CliError(str(exc)) from exc


def _add_generate(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt with speculative decoding")
    add_model_args(p)
    p.add_argument("--method", default="pld", help=f"one of {', '.join(METHODS)}")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="file holding the prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    add_sampling_args(p)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--sizing", default="cost", choices=list(SIZINGS),
                   help="tree/draft-length policy: measured cost model (default), a fixed node budget, HF's "
                        "heuristic schedule, a confidence threshold, Thompson sampling (EESD); ldlp needs "
                        "`rasd train ldlp`")
    p.add_argument("--eesd", default=None, help="EESD exit layer (default $RASD_HOME/eesd/<model>.safetensors)")
    p.add_argument("--ldlp", default=None, help="LDLP for adaeagle / --sizing ldlp (default under $RASD_HOME/ldlp/)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(func=run_generate)


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt text from --prompt or --prompt-file; empty prompts are an error."""
    if args.prompt_file is not None:
        try:
            text = args.prompt_file.read_text()
        except OSError as exc:
            raise CliError(f"cannot read prompt file {args.prompt_file}: {exc.strerror}") from exc
    else:
        text = args.prompt
    if not text or not text.strip():
        raise CliError("the prompt is empty")
    return text


def encode_prompt(tokenizer: Any, text: str, chat: bool) -> list[int]:
    """Token ids of the prompt, through the chat template when asked."""
    if not chat:
        return list(tokenizer(text)["input_ids"])
    if getattr(tokenizer, "chat_template", None) is None:
        raise CliError("--chat was given but the model's tokenizer has no chat template")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def load_target(args: argparse.Namespace) -> tuple[Any, Any]:
    """Target and optional draft model, turning load failures into one-line errors."""
    from rasd.decoding.models import ModelLoadError, load_draft, load_model

    try:
        target = load_model(args.model, device=args.device, dtype=args.dtype)
        draft = load_draft(args.draft_model, target, getattr(args, "eesd", None))
    except (ModelLoadError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    return target, draft


def validate_method(method: str, draft_model: str | None) -> None:
    """Fail before loading any model when the method cannot run."""
    if method not in METHODS:
        raise CliError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if method == "draft" and not draft_model:
        raise CliError("method 'draft' needs --draft-model (a small model sharing the target's tokenizer, or `eesd` "
                       "for the target's own early-exit draft)")


def check_trained(method: str, model: str, sizing: str, draft_model: str | None, eesd: str | None = None,
                  ldlp: str | None = None) -> None:
    """Fail before loading any model when `eesd` / `adaeagle` / `--sizing ldlp` lack trained weights."""
    from rasd.decoding.ldlp import ldlp_path
    from rasd.decoding.models import is_self_draft
    from rasd.decoding.proposers.early_exit import eesd_path

    self_draft = (method == "eesd" or is_self_draft(draft_model)
                  or (method in ("adaeagle", "optree") and not draft_model))
    if self_draft:
        file = Path(eesd) if eesd else eesd_path(model)
        if not file.exists():
            raise CliError(f"method {method!r} needs a trained EESD exit layer ({file} is missing): run "
                           f"`rasd train eesd --model {model} --data builtin` (or pass --eesd PATH)")
    if method == "adaeagle" or sizing == "ldlp":
        drafter = "eesd" if self_draft else "draft-model"
        file = Path(ldlp) if ldlp else ldlp_path(model, drafter)
        if not file.exists():
            raise CliError(f"{'method adaeagle' if method == 'adaeagle' else 'sizing ldlp'} needs a trained LDLP "
                           f"({file} is missing): run `rasd train ldlp --model {model} --drafter "
                           f"{'eesd' if self_draft else 'PATH'}` (or pass --ldlp PATH)")


def run_generate(args: argparse.Namespace) -> int:
    """Generate, streaming text to stdout (or one JSON object with --json), statistics on stderr."""
    from rasd.decoding.engine import build_decoder

    validate_method(args.method, args.draft_model)
    check_trained(args.method, args.model, args.sizing, args.draft_model, args.eesd, args.ldlp)
    text = read_prompt(args)
    if args.max_new_tokens < 1:
        raise CliError("--max-new-tokens must be at least 1")
    sampling = sampling_from_args(args)
    target, draft = load_target(args)
    prompt_ids = encode_prompt(target.tokenizer, text, args.chat)
    if len(prompt_ids) + 1 > target.max_context:
        raise CliError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {target.max_context}")
    options = {k: v for k, v in (("eesd", args.eesd), ("ldlp", args.ldlp)) if v}
    try:
        decoder = build_decoder(target, args.method, draft=draft, sizing=args.sizing, **options)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    printer = None if args.json else TextPrinter(target.tokenizer)
    out = decoder.generate(prompt_ids, max_new_tokens=args.max_new_tokens, sampling=sampling,
                           eos_token_ids=target.eos_token_ids, stop=args.stop,
                           on_tokens=None if printer is None else printer.push)
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "stats": out.stats.to_dict()}))
    else:
        printer.finish(out.text or "")
        print(f"[{args.method}] {out.stats.summary()}", file=sys.stderr)
    return 0


class TextPrinter:
    """Streams decoded text as token blocks arrive (re-decoding keeps multi-byte characters intact)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer, self.ids, self.printed = tokenizer, [], 0

    def push(self, block: list[int]) -> None:
        self.ids.extend(block)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        safe = len(text) - 1 if text.endswith("\ufffd") else len(text)
        if safe > self.printed:
            sys.stdout.write(text[self.printed: safe])
            sys.stdout.flush()
            self.printed = safe

    def finish(self, final_text: str) -> None:
        """Print what is left; if a stop string cut the text, nothing past it is printed."""
        if len(final_text) > self.printed:
            sys.stdout.write(final_text[self.printed:])
        sys.stdout.write("\n")
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `rasd` console script."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()   # keep stderr to our own one-line messages
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"rasd: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
