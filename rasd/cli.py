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

from rasd.cli_options import (
    add_model_args,
    add_repetition_args,
    add_sampling_args,
    check_method,
    load_target,
    method_help,
    repetition_from_args,
    sampling_from_args,
)
from rasd.decoding.sizing.sizers import SIZINGS
from rasd.errors import CliError
from rasd.text import TextPrinter, encode_prompt, has_chat_template


def build_parser() -> argparse.ArgumentParser:
    """All subcommands; `bench` lives with its pipeline."""
    parser = argparse.ArgumentParser(prog="rasd", description="Lossless retrieval-augmented speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    from rasd.apps import docqa
    from rasd.eval import bench, fault, ingest_check, load, report
    from rasd.index import cli as index_cli
    from rasd.serve import options as serve_options

    bench.register(sub)
    index_cli.register(sub)
    docqa.register(sub)
    serve_options.register(sub)
    load.register(sub)
    fault.register(sub)
    ingest_check.register(sub)
    report.register(sub)
    _add_train(sub)
    return parser


def _add_train(sub: Any) -> None:
    """`rasd train {eagle,eesd,ldlp}`: the learned parts of the self-draft and of AdaEAGLE's length predictor."""
    from rasd.train import eagle_head, eesd, ldlp

    p = sub.add_parser("train", help="train the EAGLE head, EESD's exit layer or AdaEAGLE's length predictor")
    what = p.add_subparsers(dest="what", required=True)
    eagle_head.add_parser(what)
    eesd.add_parser(what)
    ldlp.add_parser(what)


def _add_generate(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt with speculative decoding")
    add_model_args(p)
    p.add_argument("--method", default="pld", help=method_help("pld"))
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="file holding the prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    add_sampling_args(p)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    add_repetition_args(p, on=False)
    p.add_argument("--sizing", default="cost", choices=list(SIZINGS),
                   help="tree/draft-length policy: measured cost model (default), a fixed node budget, HF's "
                        "heuristic schedule, a confidence threshold, Thompson sampling (EESD); ldlp needs "
                        "`rasd train ldlp`")
    p.add_argument("--eesd", default=None, help="EESD exit layer (default $RASD_HOME/eesd/<model>.safetensors)")
    p.add_argument("--ldlp", default=None, help="LDLP for adaeagle / --sizing ldlp (default under $RASD_HOME/ldlp/)")
    p.add_argument("--eagle", default=None, help="EAGLE head for `eagle` (default: trained under $RASD_HOME/eagle/, "
                                                 "else the one shipped for the embedded model)")
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


def run_generate(args: argparse.Namespace) -> int:
    """Generate, streaming text to stdout (or one JSON object with --json), statistics on stderr."""
    from rasd.decoding.runtime.engine import build_decoder

    check_method(args.method, args.model, args.draft_model, args.sizing, args.eesd, args.ldlp, args.eagle)
    text = read_prompt(args)
    if args.max_new_tokens < 1:
        raise CliError("--max-new-tokens must be at least 1")
    sampling = sampling_from_args(args)
    repetition = repetition_from_args(args)
    target, draft = load_target(args)
    if args.chat and not has_chat_template(target.tokenizer):
        raise CliError("--chat was given but the model's tokenizer has no chat template")
    prompt_ids = encode_prompt(target.tokenizer, text, args.chat)
    if len(prompt_ids) + 1 > target.max_context:
        raise CliError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {target.max_context}")
    options = {k: v for k, v in (("eesd", args.eesd), ("ldlp", args.ldlp), ("eagle", args.eagle)) if v}
    try:
        decoder = build_decoder(target, args.method, draft=draft, sizing=args.sizing, **options)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    printer = None if args.json else TextPrinter(target.tokenizer)
    out = decoder.generate(prompt_ids, max_new_tokens=args.max_new_tokens, sampling=sampling,
                           eos_token_ids=target.eos_token_ids, stop=args.stop,
                           on_tokens=None if printer is None else printer.push, repetition=repetition)
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "stats": out.stats.to_dict()}))
    else:
        printer.finish(out.text or "")
        print(f"[{args.method}] {out.stats.summary()}", file=sys.stderr)
    return 0


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
