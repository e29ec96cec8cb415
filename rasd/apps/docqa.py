"""Document QA in-process: retrieve chunks, ask the model with a cited prompt, decode speculatively.

The index serves twice: its vectors pick the chunks the prompt cites, and its token suffix array (the whole
datastore, plus the retrieved documents as a per-request scope) is where `retrieval` and `rasd` draft from.
Answers usually copy spans of the sources, which is exactly what those drafts guess.
The same class runs behind `rasd ask`, the benchmark's document-QA mode and (later) the service.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rasd.decoding.proposers import RecyclingMatrix, method_spec
from rasd.decoding.proposers.recycling import matrix_path
from rasd.decoding.runtime.engine import SpeculativeDecoder, build_decoder, vocab_size
from rasd.decoding.runtime.repetition import DEFAULT_WINDOW
from rasd.decoding.runtime.stats import DecodeStats
from rasd.decoding.step.sampling import GREEDY, SamplingParams
from rasd.text import as_id_list, encode_chat, has_chat_template

SYSTEM_PROMPT = ("You answer questions using only the numbered sources the user gives. Quote the sources where "
                 "you can and cite them like [1]. If the sources do not contain the answer, say so.")
DEFAULT_TOP_K = 4


@dataclass
class Source:
    """One retrieved chunk as the answer cites it ([rank] in the prompt is its 1-based position)."""

    doc_id: int
    chunk_id: int
    score: float
    text: str
    title: str = ""
    source: str = ""

    @classmethod
    def from_hit(cls, hit: Any) -> Source:
        """A source from an index search hit."""
        return cls(doc_id=int(hit.doc_id), chunk_id=int(hit.chunk_id), score=float(hit.score), text=hit.text,
                   title=getattr(hit, "title", "") or "", source=getattr(hit, "source", "") or "")


@dataclass
class Answer:
    """What `ask` returns: the answer text, the sources it was given, and the decoding statistics."""

    answer: str
    sources: list[Source]
    stats: DecodeStats
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"answer": self.answer, "sources": [asdict(s) for s in self.sources], "stats": self.stats.to_dict(),
                "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens}


def user_message(question: str, sources: list[Source]) -> str:
    """Numbered sources, then the question: the layout the answer's [n] citations refer to."""
    blocks = [f"[{i}] {(s.title + ': ') if s.title else ''}{s.text.strip()}" for i, s in enumerate(sources, 1)]
    return "Sources:\n" + "\n\n".join(blocks) + f"\n\nQuestion: {question.strip()}"


def encode_messages(tokenizer: Any, question: str, sources: list[Source], chat: bool = True) -> list[int]:
    """Prompt token ids through the chat template (system + user) where the tokenizer has one."""
    user = user_message(question, sources)
    if chat and has_chat_template(tokenizer):
        return encode_chat(tokenizer, [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}])
    return as_id_list(tokenizer(f"{SYSTEM_PROMPT}\n\n{user}\n\nAnswer:")["input_ids"])


def fit_sources(tokenizer: Any, question: str, sources: list[Source], max_prompt_tokens: int,
                chat: bool = True) -> tuple[list[int], list[Source]]:
    """Drop the lowest-ranked sources until the prompt fits; a question that alone is too long is an error."""
    kept = list(sources)
    while True:
        ids = encode_messages(tokenizer, question, kept, chat)
        if len(ids) <= max_prompt_tokens:
            return ids, kept
        if not kept:
            raise ValueError(f"the question alone has {len(ids)} prompt tokens; the limit is {max_prompt_tokens}")
        kept.pop()


class DocQA:
    """Question → retrieved sources → cited prompt → speculative decoding with the index as datastore."""

    def __init__(self, index: Any, target: Any, method: str = "rasd", draft: Any = None,
                 top_k: int = DEFAULT_TOP_K, chat: bool = True, max_new_tokens: int = 256,
                 sizing: str = "cost", recycling: Any = None, repetition: int = DEFAULT_WINDOW):
        """`repetition`: the repetition stop's window (`runtime.repetition`), on by default: a small model's
        answer that loops reads broken, and its loop would be drafted for free. 0: off."""
        from rasd.index.store import check_tokenizer

        check_tokenizer(index, target)
        self.index, self.target, self.method = index, target, method
        self.top_k, self.chat, self.max_new_tokens, self.repetition = top_k, chat, max_new_tokens, repetition
        spec = method_spec(method)
        extra: dict[str, Any] = {"datastores": index.datastores()} if spec.uses_index else {}
        if recycling is not None and spec.uses_recycling:
            extra["recycling"] = recycling      # a hot matrix from earlier runs (see `recycling_for`)
        self.decoder: SpeculativeDecoder = build_decoder(target, method, draft=draft, sizing=sizing, **extra)

    def retrieve(self, question: str, top_k: int | None = None) -> list[Source]:
        if not question or not question.strip():
            raise ValueError("the question is empty")
        return [Source.from_hit(h) for h in self.index.search(question, k=top_k or self.top_k)]

    def prepare(self, question: str, top_k: int | None = None) -> tuple[list[int], list[Source]]:
        """Prompt ids and the sources that fit, with room left for the answer in the model's window."""
        sources = self.retrieve(question, top_k)
        budget = self.target.max_context - self.max_new_tokens - 1
        return fit_sources(self.target.tokenizer, question, sources, budget, self.chat)

    def scope(self, sources: list[Source]) -> None:
        """Point the proposer's per-request datastore at the documents the answer will draw on (only methods
        that use the index: reading the documents is a call per shard)."""
        if method_spec(self.method).uses_index:
            self.decoder.proposer.scope(self.index.source_tokens(sources))

    def ask(self, question: str, max_new_tokens: int | None = None, sampling: SamplingParams | None = None,
            top_k: int | None = None, on_tokens: Callable[[list[int]], None] | None = None) -> Answer:
        """Answer one question; `on_tokens` receives committed token blocks as they are accepted."""
        ids, sources = self.prepare(question, top_k)
        self.scope(sources)
        out = self.decoder.generate(ids, max_new_tokens=max_new_tokens or self.max_new_tokens,
                                    sampling=sampling or GREEDY, eos_token_ids=self.target.eos_token_ids,
                                    on_tokens=on_tokens, repetition=self.repetition)
        return Answer(answer=(out.text or "").strip(), sources=sources, stats=out.stats, token_ids=out.token_ids,
                      finish_reason=out.finish_reason, prompt_tokens=len(ids))


# ------------------------------------------------------------------------------------------------ CLI


def register(subparsers: Any) -> Any:
    """`rasd ask`: one question against an index, answer streamed, then sources and statistics."""
    from rasd.cli_options import add_model_args, add_repetition_args, add_sampling_args, method_help

    p = subparsers.add_parser("ask", help="answer a question from an index of documents")
    p.add_argument("question", help="the question")
    p.add_argument("--index", required=True,
                   help="index folder (`rasd index build`), or `sample` for the bundled Python language reference")
    add_model_args(p)
    p.add_argument("--method", default="rasd", help=method_help("rasd"))
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help="retrieved chunks cited in the prompt")
    p.add_argument("--max-new-tokens", type=int, default=256)
    add_sampling_args(p, top_k_flag="--sample-top-k")
    add_repetition_args(p, on=True)
    p.add_argument("--json", action="store_true", help='print {"answer", "sources", "stats"} as one JSON object')
    p.set_defaults(func=run_ask)
    return p


def open_index(spec: str, model: str) -> Any:
    """An index by folder, or the sample index (built at first use) for `sample`."""
    from rasd.errors import CliError
    from rasd.index.store import Index, IndexOpenError

    if spec == "sample":
        from rasd.apps.sample_corpus import ensure_sample_index

        spec = str(ensure_sample_index(model))
    try:
        return Index.open(spec)
    except IndexOpenError as exc:
        raise CliError(str(exc)) from exc


def save_quietly(matrix: RecyclingMatrix, path: Path) -> None:
    """Keep what this run recycled for the next one; a read-only cache folder only costs the hot start."""
    try:
        matrix.save(path)
    except OSError as exc:
        print(f"note: could not save the recycling matrix to {path}: {exc}", file=sys.stderr)


def run_ask(args: Any) -> int:
    """Retrieve, stream the answer to stdout, then the sources and a statistics line (stderr)."""
    import json

    from rasd.cli_options import check_method, load_target, repetition_from_args, sampling_from_args
    from rasd.errors import CliError
    from rasd.text import TextPrinter

    check_method(args.method, args.model, args.draft_model)
    if not args.question.strip():
        raise CliError("the question is empty")
    if args.top_k < 1 or args.max_new_tokens < 1:
        raise CliError("--top-k and --max-new-tokens must be at least 1")
    sampling = sampling_from_args(args)
    repetition = repetition_from_args(args)
    index = open_index(args.index, args.model)
    target, draft = load_target(args)
    try:
        recycling = RecyclingMatrix.load_or_new(matrix_path(target.name), vocab_size(target.model))
        qa = DocQA(index, target, method=args.method, draft=draft, top_k=args.top_k,
                   max_new_tokens=args.max_new_tokens, recycling=recycling, repetition=repetition)
        printer = None if args.json else TextPrinter(target.tokenizer)
        answer = qa.ask(args.question, sampling=sampling, on_tokens=None if printer is None else printer.push)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    save_quietly(recycling, matrix_path(target.name))
    if args.json:
        print(json.dumps(answer.to_dict()))
        return 0
    printer.finish(answer.answer)
    print("\nSources:")
    for i, s in enumerate(answer.sources, 1):
        where = s.title or s.source or f"doc {s.doc_id}"
        print(f"  [{i}] {where} (chunk {s.chunk_id}, score {s.score:.3f})")
    if answer.finish_reason == "repetition":
        print(f"(the answer began to repeat its last {repetition} tokens and was stopped there; "
              "--no-stop-on-repetition shows it all)", file=sys.stderr)
    print(f"[{args.method}] {answer.stats.summary()}", file=sys.stderr)
    return 0
