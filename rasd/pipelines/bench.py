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

Data files are read where they are (e.g. `../shared/data`), never copied.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rasd.decoding.models import LoadedModel

HF_METHODS = ("hf", "hf-pld", "hf-assisted")
DEFAULT_METHODS = "ar,hf,hf-pld,pld"
HF_PLD_NUM_TOKENS = 10  # HF's prompt-lookup window, the value Spec-Bench and the HF docs use
WARMUP_MAX_NEW_TOKENS = 16
OVERALL = "overall"
SUMMARY_KEYS = ("tokens_per_s", "e2e_tokens_per_s", "speedup_vs_hf", "speedup_vs_ar", "median_speedup_vs_hf",
                "median_speedup_vs_ar", "mean_accepted_tokens", "greedy_match_rate", "num_prompts")


# --------------------------------------------------------------------------------------------- data


@dataclass
class BenchItem:
    """One benchmark question before tokenisation.

    `context` is the part of `text` that may be shortened when the prompt is longer than the model's
    window (LongBench's documents); None where the record has no separate context slot.
    """

    question_id: str | int
    category: str
    text: str
    context: str | None = None
    dataset: str | None = None


@dataclass
class BenchPrompt:
    """A tokenised prompt, with how many tokens truncation removed (0 if none)."""

    index: int
    item: BenchItem
    input_ids: list[int]
    truncated_tokens: int = 0
    scope: Any = None          # RetrievalScope (bench_docqa) for retrieval methods, None otherwise


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """Yield the JSON objects of a `.jsonl` or `.jsonl.gz` file, skipping blank lines."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)


def parse_record(record: dict[str, Any], index: int, default_category: str) -> BenchItem | None:
    """Turn one dataset row into a BenchItem, or None if it holds no usable prompt.

    Recognised shapes: Spec-Bench / MT-bench (`turns`: the first turn is the prompt), LongBench
    (`prompt`, or `context` + `question`), and plain `question` rows (GSM8K-style).
    """
    dataset = record.get("dataset")
    category = str(record.get("category") or dataset or default_category)
    qid = _question_id(record, index)
    context = record.get("context") if isinstance(record.get("context"), str) else None
    turns = record.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str):
        return BenchItem(qid, category, turns[0], None, dataset)
    prompt = record.get("prompt")
    if isinstance(prompt, str) and prompt.strip():
        usable = context if context and context in prompt else None
        return BenchItem(qid, category, prompt, usable, dataset)
    question = record.get("question")
    if isinstance(question, str) and question.strip():
        if context:
            return BenchItem(qid, category, f"{context}\n\n{question}", context, dataset)
        return BenchItem(qid, category, question, None, dataset)
    return None


def _question_id(record: dict[str, Any], index: int) -> str | int:
    """The record's own id where it has one (Spec-Bench `question_id`, LongBench dataset + key)."""
    for key in ("question_id", "task_id", "id"):
        if record.get(key) is not None:
            return record[key]
    if record.get("source_key") is not None:
        return f"{record.get('dataset', 'row')}-{record['source_key']}"
    return index


def load_items(path: str | Path, categories: Sequence[str] | None = None,
               limit: int | None = None) -> list[BenchItem]:
    """Read a dataset file, keep the wanted categories and at most `limit` prompts per category.

    A category filter matches either the `category` or the `dataset` field, so LongBench can be cut by
    task (`hotpotqa`) as well as by group (`multi-doc QA`). File order is kept: the first N per category.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset {path} not found")
    wanted = set(categories or ())
    default_category = path.name.split(".")[0]
    items: list[BenchItem] = []
    per_category: dict[str, int] = {}
    for index, record in enumerate(read_jsonl(path)):
        item = parse_record(record, index, default_category)
        if item is None or (wanted and not wanted & {item.category, item.dataset}):
            continue
        if limit is not None and per_category.get(item.category, 0) >= limit:
            continue
        per_category[item.category] = per_category.get(item.category, 0) + 1
        items.append(item)
    if not items:
        raise ValueError(f"no prompts in {path}" + (f" for categories {sorted(wanted)}" if wanted else ""))
    return items


def as_id_list(encoded: Any) -> list[int]:
    """Input ids as a flat list[int] from whatever a tokenizer returned.

    transformers 5's `apply_chat_template(tokenize=True)` returns a BatchEncoding, older versions a list;
    tensors and batch-of-one nesting also occur.
    """
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], list):
        if len(encoded) != 1:
            raise ValueError("expected one sequence of token ids, got a batch")
        encoded = encoded[0]
    return [int(t) for t in encoded]


def encode_prompt(tokenizer: Any, text: str, chat: bool = True) -> list[int]:
    """Token ids of a user message: the chat template with a generation prompt where the tokenizer has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        return as_id_list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    return as_id_list(tokenizer(text)["input_ids"])


def _keep_tokens(ids: list[int], keep: int, side: str) -> list[int]:
    """Keep `keep` tokens: the end (`left`: cut from the left) or both ends (`middle`, LongBench's rule)."""
    if keep <= 0:
        return []
    if side == "left":
        return ids[-keep:]
    head = keep // 2
    return ids[:head] + ids[len(ids) - (keep - head):]


def fit_prompt(item: BenchItem, tokenizer: Any, max_prompt_tokens: int, index: int = 0,
               chat: bool = True) -> BenchPrompt | None:
    """Tokenise `item`, shortening it to `max_prompt_tokens` if needed; None if it cannot fit.

    A separate context (LongBench documents) is cut from the left, so the instruction before it and the
    question after it survive. A prompt without one is cut in the middle, LongBench's own rule, which keeps
    the instruction and the question at the two ends. Decode/re-encode can shift a boundary by a token, so
    the cut is re-checked and deepened a few times.
    """
    ids = encode_prompt(tokenizer, item.text, chat)
    if len(ids) <= max_prompt_tokens:
        return BenchPrompt(index, item, ids)
    piece = item.context if item.context and item.context in item.text else item.text
    side = "left" if piece is item.context else "middle"
    piece_ids = as_id_list(tokenizer(piece, add_special_tokens=False)["input_ids"])
    excess = len(ids) - max_prompt_tokens
    for _ in range(5):
        keep = len(piece_ids) - excess
        if keep <= 0:
            return None
        text = item.text.replace(piece, tokenizer.decode(_keep_tokens(piece_ids, keep, side)), 1)
        new_ids = encode_prompt(tokenizer, text, chat)
        if len(new_ids) <= max_prompt_tokens:
            return BenchPrompt(index, item, new_ids, truncated_tokens=len(ids) - len(new_ids))
        excess += len(new_ids) - max_prompt_tokens + 2
    return None


def prepare_prompts(items: Sequence[BenchItem], tokenizer: Any, max_prompt_tokens: int,
                    long_prompts: str = "truncate", chat: bool = True,
                    log: Callable[[str], None] = print) -> list[BenchPrompt]:
    """Tokenise every item; truncate or skip the ones longer than the budget, saying which."""
    prompts: list[BenchPrompt] = []
    for item in items:
        index = len(prompts)
        if long_prompts == "skip":
            ids = encode_prompt(tokenizer, item.text, chat)
            if len(ids) > max_prompt_tokens:
                log(f"skip {item.category}/{item.question_id}: {len(ids)} prompt tokens "
                    f"> {max_prompt_tokens}")
                continue
            prompts.append(BenchPrompt(index, item, ids))
            continue
        prompt = fit_prompt(item, tokenizer, max_prompt_tokens, index, chat)
        if prompt is None:
            log(f"skip {item.category}/{item.question_id}: cannot fit {max_prompt_tokens} prompt tokens")
            continue
        if prompt.truncated_tokens:
            where = "context from the left" if item.context else "prompt in the middle"
            log(f"truncated {item.category}/{item.question_id}: {prompt.truncated_tokens} tokens of the "
                f"{where} (now {len(prompt.input_ids)} tokens)")
        prompts.append(prompt)
    return prompts


# ------------------------------------------------------------------------------------------ running


@dataclass
class SamplingConfig:
    """Sampling settings shared by our engine and HF; temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def prompt_seed(self, index: int) -> int | None:
        """A per-prompt seed so sampled runs are reproducible and prompts do not share a random stream."""
        return None if self.seed is None else self.seed + index


@dataclass
class RunRecord:
    """One method's generation for one prompt: tokens and the timings the aggregation needs.

    `decode_tokens` / `decode_time_s` are the decode phase: tokens that arrived after the first new
    token's forward and the time since it. `steps` counts target forwards that produced tokens.
    """

    method: str
    index: int
    question_id: str | int
    category: str
    token_ids: list[int]
    finish_reason: str
    prefill_time_s: float
    decode_time_s: float
    total_time_s: float
    decode_tokens: int
    steps: int | None = None
    mean_accepted_tokens: float | None = None
    accept_lengths: list[int] | None = None
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    # Per-step detail for `--report` (our engine only; None for HF): draft nodes verified, depth of the
    # verified tree, and the prompt length (with the accept lengths it gives each step's context length).
    tree_sizes: list[int] | None = None
    tree_depths: list[int] | None = None
    drafted_by_source: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float | None:
        """Decode-phase speed of this one prompt; None when there was no decode phase."""
        if self.decode_tokens <= 0 or self.decode_time_s <= 0:
            return None
        return self.decode_tokens / self.decode_time_s


class Runner(Protocol):
    """Anything that can generate for a prompt and report a RunRecord (method/prompt fields left blank)."""

    name: str

    def run(self, prompt_ids: list[int], max_new_tokens: int, seed: int | None) -> RunRecord: ...

    def prepare(self, prompts: Sequence[BenchPrompt], max_new_tokens: int) -> None: ...


def _sync(device: str) -> None:
    """Wait for queued GPU work so wall-clock timestamps mean something."""
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _timing_streamer_class() -> type:
    """Build the streamer class lazily so importing this module does not import transformers."""
    from transformers.generation.streamers import BaseStreamer

    class TimingStreamer(BaseStreamer):
        """Records when HF's first new token arrives and how many tokens each step emitted.

        `generate` first puts the prompt, then each step's accepted tokens (one for plain decoding,
        the accepted block for prompt lookup / assisted generation).
        """

        def __init__(self, device: str) -> None:
            self.device = device
            self.prompt_seen = False
            self.first_token_time: float | None = None
            self.chunks: list[int] = []

        def put(self, value: Any) -> None:
            if not self.prompt_seen:
                self.prompt_seen = True
                return
            if self.first_token_time is None:
                _sync(self.device)
                self.first_token_time = time.perf_counter()
            self.chunks.append(int(value.numel()))

        def end(self) -> None:
            pass

    return TimingStreamer


@contextlib.contextmanager
def plain_generation_config(model: Any, eos_ids: Sequence[int], pad_id: int) -> Iterator[None]:
    """Swap in a bare GenerationConfig while HF generates.

    A model's shipped generation config may add a repetition penalty, sampling defaults or other
    processors that our engine does not apply; the baseline must be plain decoding of the same
    distribution, or "speedup" and "greedy match" compare different things.
    """
    from transformers import GenerationConfig

    saved = model.generation_config
    bos = getattr(saved, "bos_token_id", None)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=list(eos_ids),
                                               pad_token_id=pad_id)
    try:
        yield
    finally:
        model.generation_config = saved


class HFRunner:
    """HF `generate` baselines: `hf` (plain), `hf-pld` (prompt lookup), `hf-assisted` (draft model)."""

    def __init__(self, name: str, target: LoadedModel, sampling: SamplingConfig,
                 draft: LoadedModel | None = None) -> None:
        if name not in HF_METHODS:
            raise ValueError(f"unknown HF method {name!r}")
        if name == "hf-assisted" and draft is None:
            raise ValueError("hf-assisted needs --draft-model")
        self.name = name
        self.target = target
        self.draft = draft
        self.sampling = sampling
        self.eos_ids = sorted(target.eos_token_ids)
        pad = target.tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_ids[0]
        self.streamer_cls = _timing_streamer_class()

    def _generate_kwargs(self, max_new_tokens: int) -> dict[str, Any]:
        """Stopping and decoding settings identical to what our engine gets."""
        kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "eos_token_id": self.eos_ids,
                                  "pad_token_id": self.pad_id, "min_new_tokens": 0}
        if self.sampling.greedy:
            kwargs["do_sample"] = False
        else:
            kwargs.update(do_sample=True, temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                          top_k=self.sampling.top_k)
        if self.name == "hf-pld":
            kwargs["prompt_lookup_num_tokens"] = HF_PLD_NUM_TOKENS
        elif self.name == "hf-assisted":
            kwargs["assistant_model"] = self.draft.model
        return kwargs

    def prepare(self, prompts: Sequence[BenchPrompt], max_new_tokens: int) -> None:
        """Nothing to calibrate for HF."""

    def run(self, prompt_ids: list[int], max_new_tokens: int, seed: int | None) -> RunRecord:
        import torch

        model = self.target.model
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.target.device)
        streamer = self.streamer_cls(self.target.device)
        if seed is not None:
            torch.manual_seed(seed)
        with torch.inference_mode(), plain_generation_config(model, self.eos_ids, self.pad_id):
            _sync(self.target.device)
            start = time.perf_counter()
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), streamer=streamer,
                                 **self._generate_kwargs(max_new_tokens))
            _sync(self.target.device)
            end = time.perf_counter()
        token_ids = out[0, len(prompt_ids):].tolist()
        return _hf_record(self.name, token_ids, self.eos_ids, streamer.first_token_time, streamer.chunks,
                          start, end)


def _hf_record(method: str, token_ids: list[int], eos_ids: Sequence[int], first_token_time: float | None,
               chunks: list[int], start: float, end: float) -> RunRecord:
    """Timings of one HF generation from the streamer's observations.

    Like our engine's statistics, the forward that produced the first new token(s) is prefill; steps and
    accept lengths count only the forwards after it (so plain `hf` is exactly 1.00 accepted per step).
    """
    first = first_token_time if first_token_time is not None else end
    first_chunk = chunks[0] if chunks else len(token_ids)
    finish = "eos" if token_ids and token_ids[-1] in set(eos_ids) else "length"
    decode_chunks = list(chunks[1:])
    steps = len(decode_chunks)
    return RunRecord(method=method, index=-1, question_id="", category="", token_ids=token_ids,
                     finish_reason=finish, prefill_time_s=first - start, decode_time_s=end - first,
                     total_time_s=end - start, decode_tokens=max(len(token_ids) - first_chunk, 0),
                     steps=steps, mean_accepted_tokens=(sum(decode_chunks) / steps) if steps else None,
                     accept_lengths=decode_chunks)


class EngineRunner:
    """Our engine (`ar`, `pld`, `draft`, ...) through `build_decoder`."""

    def __init__(self, name: str, target: LoadedModel, sampling: SamplingConfig,
                 draft: LoadedModel | None = None) -> None:
        from rasd.decoding.engine import build_decoder

        self.name = name
        self.target = target
        self.sampling = sampling
        self.eos_ids = set(target.eos_token_ids)
        self.decoder = build_decoder(target, name, draft=draft)
        self.curves: dict[str, Any] = {}       # cost curves the sizer used, by key (for the report)
        self.tree_depths: list[int] = []
        _record_tree_depths(self.decoder, self.tree_depths)

    def prepare(self, prompts: Sequence[BenchPrompt], max_new_tokens: int) -> None:
        """Load (or measure, once per context bucket) every cost curve the prompts will need, now.

        The engine measures its verification cost curve lazily on the first step in a new context bucket;
        that must not happen inside a timed generation, or one prompt absorbs seconds of calibration.
        """
        curve_for = getattr(getattr(self.decoder, "sizer", None), "curve_for", None)
        if not callable(curve_for):
            return
        curves = self.__dict__.setdefault("curves", {})
        for prompt in prompts:
            start = len(prompt.input_ids)
            for context_len in range(start, start + max_new_tokens + 1):
                curve = curve_for(context_len)
                if getattr(curve, "key", None) is not None:
                    curves[curve.key] = curve

    def bind(self, prompt: BenchPrompt) -> None:
        """Point a retrieval proposer at this prompt's datastores and retrieved documents (untimed)."""
        scope, proposer = prompt.scope, self.decoder.proposer
        if scope is None:
            return
        if hasattr(proposer, "set_datastores"):
            proposer.set_datastores(scope.datastores)
        if hasattr(proposer, "scope"):
            proposer.scope(scope.scope_docs or None)

    def run(self, prompt_ids: list[int], max_new_tokens: int, seed: int | None) -> RunRecord:
        from rasd.decoding.sampling import SamplingParams

        params = SamplingParams(temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                                top_k=self.sampling.top_k, seed=seed)
        self.tree_depths.clear()
        _sync(self.target.device)
        start = time.perf_counter()
        out = self.decoder.generate(prompt_ids, max_new_tokens=max_new_tokens, sampling=params,
                                    eos_token_ids=self.eos_ids)
        _sync(self.target.device)
        wall = time.perf_counter() - start
        stats = out.stats
        token_ids = [int(t) for t in out.token_ids]
        return RunRecord(method=self.name, index=-1, question_id="", category="", token_ids=token_ids,
                         finish_reason=out.finish_reason, prefill_time_s=stats.prefill_time_s,
                         decode_time_s=stats.decode_time_s, total_time_s=wall,
                         decode_tokens=max(len(token_ids) - 1, 0), steps=stats.steps,
                         mean_accepted_tokens=stats.mean_accepted_tokens,
                         accept_lengths=list(stats.accept_lengths),
                         accepted_by_source=dict(stats.accepted_by_source),
                         tree_sizes=list(stats.tree_sizes),
                         tree_depths=list(self.tree_depths) if len(self.tree_depths) == stats.steps else None,
                         drafted_by_source=dict(stats.drafted_by_source))


def _record_tree_depths(decoder: Any, depths: list[int]) -> None:
    """Note the depth of every verified tree into `depths` (DecodeStats keeps sizes, not depths).

    The engine hands each verified tree to `sizer.observe` once per step, right after recording the step,
    so wrapping this decoder's own sizer instance is enough; nothing else about it changes.
    """
    sizer = getattr(decoder, "sizer", None)
    observe = getattr(sizer, "observe", None)
    if not callable(observe):
        return

    def observe_and_record(tree: Any, *args: Any, **kwargs: Any) -> Any:
        depths.append(max(tree.depths()) if len(tree) > 1 else 0)
        return observe(tree, *args, **kwargs)

    sizer.observe = observe_and_record


def make_runner(name: str, target: LoadedModel, sampling: SamplingConfig,
                draft: LoadedModel | None = None) -> Runner:
    """HF baselines by name; every other name is one of our engine's methods."""
    if name in HF_METHODS:
        return HFRunner(name, target, sampling, draft)
    return EngineRunner(name, target, sampling, draft)


def rotated(seq: Sequence[Runner], shift: int) -> list[Runner]:
    """Rotate the method order per prompt so no method always runs right after another (cache effects)."""
    if not seq:
        return []
    shift %= len(seq)
    return list(seq[shift:]) + list(seq[:shift])


def run_prompts(runners: Sequence[Runner], prompts: Sequence[BenchPrompt], max_new_tokens: int,
                sampling: SamplingConfig, warmup: bool = True, progress: bool = True) -> list[RunRecord]:
    """Run every method on every prompt, interleaved, after one untimed warm-up per method."""
    from tqdm.auto import tqdm

    for runner in runners:
        runner.prepare(prompts, max_new_tokens)
    if warmup and prompts:
        warm_tokens = min(max_new_tokens, WARMUP_MAX_NEW_TOKENS)
        for runner in runners:
            _bind(runner, prompts[0])
            runner.run(prompts[0].input_ids, warm_tokens, sampling.prompt_seed(0))
    records: list[RunRecord] = []
    for prompt in tqdm(prompts, desc="bench", unit="prompt", disable=not progress, file=sys.stderr):
        for runner in rotated(runners, prompt.index):
            _bind(runner, prompt)
            record = runner.run(prompt.input_ids, max_new_tokens, sampling.prompt_seed(prompt.index))
            record.method, record.index = runner.name, prompt.index
            record.prompt_tokens = len(prompt.input_ids)
            record.question_id, record.category = prompt.item.question_id, prompt.item.category
            records.append(record)
    return records


def _bind(runner: Runner, prompt: BenchPrompt) -> None:
    bind = getattr(runner, "bind", None)
    if callable(bind):
        bind(prompt)


# -------------------------------------------------------------------------------------- aggregation


def _ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None where either is missing or the denominator is not positive."""
    if num is None or den is None or den <= 0 or not math.isfinite(num):
        return None
    return num / den


def _median(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(kept) if kept else None


def summarize_group(records: Sequence[RunRecord]) -> dict[str, Any]:
    """Speed and acceptance of one method over a set of prompts (ratios of sums, not means of ratios)."""
    decode_tokens = sum(r.decode_tokens for r in records)
    decode_time = sum(r.decode_time_s for r in records)
    new_tokens = sum(r.new_tokens for r in records)
    total_time = sum(r.total_time_s for r in records)
    with_steps = [r for r in records if r.steps and r.mean_accepted_tokens is not None]
    steps = sum(r.steps for r in with_steps)
    accepted = sum(r.mean_accepted_tokens * r.steps for r in with_steps)
    return {"tokens_per_s": _ratio(decode_tokens, decode_time),
            "e2e_tokens_per_s": _ratio(new_tokens, total_time),
            "mean_accepted_tokens": _ratio(accepted, steps) if with_steps else None,
            "num_prompts": len(records)}


def match_rate(records: Sequence[RunRecord], reference: dict[int, RunRecord] | None) -> float | None:
    """Fraction of prompts whose tokens equal the reference method's, token for token."""
    if reference is None:
        return None
    pairs = [(r, reference[r.index]) for r in records if r.index in reference]
    if not pairs:
        return None
    return sum(r.token_ids == ref.token_ids for r, ref in pairs) / len(pairs)


def greedy_reference(methods: Sequence[str], greedy: bool) -> str | None:
    """The method greedy outputs are compared with: HF greedy, else our `ar`; None when sampling."""
    if not greedy:
        return None
    for name in ("hf", "ar"):
        if name in methods:
            return name
    return None


def _by_method(records: Sequence[RunRecord]) -> dict[str, dict[int, RunRecord]]:
    out: dict[str, dict[int, RunRecord]] = {}
    for r in records:
        out.setdefault(r.method, {})[r.index] = r
    return out


def _group_summary(records: Sequence[RunRecord], by_method: dict[str, dict[int, RunRecord]],
                   reference: str | None) -> dict[str, Any]:
    """summarize_group plus the per-prompt quantities that need the other methods' records."""
    summary = summarize_group(records)
    for base in ("hf", "ar"):
        others = by_method.get(base)
        if not others:
            summary[f"median_speedup_vs_{base}"] = None
            continue
        ratios = [_ratio(r.tokens_per_s, others[r.index].tokens_per_s) for r in records if r.index in others]
        summary[f"median_speedup_vs_{base}"] = _median(ratios)
    summary["greedy_match_rate"] = match_rate(records, by_method.get(reference) if reference else None)
    return summary


def aggregate(records: Sequence[RunRecord], methods: Sequence[str], greedy: bool = True) -> dict[str, Any]:
    """The `methods` section of results.json: overall and per-category summaries with speedups."""
    reference = greedy_reference(methods, greedy)
    by_method = _by_method(records)
    categories = sorted({r.category for r in records})
    out: dict[str, Any] = {}
    for name in methods:
        mine = [r for r in records if r.method == name]
        entry = _group_summary(mine, by_method, reference)
        entry["per_category"] = {c: _group_summary([r for r in mine if r.category == c], by_method, reference)
                                 for c in categories}
        out[name] = entry
    _add_speedups(out)
    return {name: _order_keys(entry) for name, entry in out.items()}


def _add_speedups(methods: dict[str, Any]) -> None:
    """speedup_vs_X = tokens_per_s / X's tokens_per_s on the same prompts (null if X was not run)."""
    for entry in methods.values():
        for base in ("hf", "ar"):
            other = methods.get(base)
            key = f"speedup_vs_{base}"
            entry[key] = _ratio(entry["tokens_per_s"], other["tokens_per_s"]) if other else None
            for cat, summary in entry["per_category"].items():
                ref = other["per_category"].get(cat) if other else None
                summary[key] = _ratio(summary["tokens_per_s"], ref["tokens_per_s"]) if ref else None


def _order_keys(entry: dict[str, Any]) -> dict[str, Any]:
    """A stable key order for readable JSON: the summary keys, then per_category."""
    ordered = {k: entry.get(k) for k in SUMMARY_KEYS}
    if "per_category" in entry:
        ordered["per_category"] = {c: _order_keys(s) for c, s in entry["per_category"].items()}
    return ordered


def build_results(meta: dict[str, Any], records: Sequence[RunRecord], methods: Sequence[str],
                  greedy: bool = True) -> dict[str, Any]:
    """The whole results.json document: run metadata, then per-method summaries."""
    results = {key: meta.get(key) for key in ("model", "device", "dtype", "torch_threads", "max_new_tokens")}
    results.update({k: v for k, v in meta.items() if k not in results})
    results["greedy_reference"] = greedy_reference(methods, greedy)
    results["methods"] = aggregate(records, methods, greedy)
    results["step_stats"] = {name: step_stats([r for r in records if r.method == name]) for name in methods}
    return results


def step_stats(records: Sequence[RunRecord]) -> dict[str, Any]:
    """Per-step detail of one method over all its prompts, for `--report` (a separate key of results.json).

    - `accept_length_hist`: steps by tokens committed (bonus included);
    - `position_acceptance`: for draft depth d = 1, 2, ...: `reached` steps whose verified tree had depth
      >= d, `accepted` steps that accepted the token at depth d (needs per-step tree depths: our engine);
    - `accepted_by_source` / `drafted_by_source`: token counts summed over prompts;
    - `tree_tokens_by_bucket`: verified tree size in tokens (root included, as on the cost curve) per
      step, counted per cost-curve context bucket of that step's context length.
    """
    lengths = [n for r in records for n in (r.accept_lengths or [])]
    out: dict[str, Any] = {"steps": len(lengths),
                           "accept_length_hist": _counts(lengths),
                           "accepted_by_source": _sum_counts(r.accepted_by_source for r in records),
                           "drafted_by_source": _sum_counts(r.drafted_by_source for r in records),
                           "position_acceptance": None, "tree_tokens_by_bucket": None}
    with_depths = [r for r in records if r.accept_lengths and r.tree_depths
                   and len(r.tree_depths) == len(r.accept_lengths)]
    pairs = [(a, d) for r in with_depths for a, d in zip(r.accept_lengths, r.tree_depths, strict=True)]
    if pairs:
        deepest = max(d for _, d in pairs)
        out["position_acceptance"] = [{"depth": d, "reached": sum(depth >= d for _, depth in pairs),
                                       "accepted": sum(acc - 1 >= d for acc, _ in pairs)}
                                      for d in range(1, deepest + 1)]
    sized = [r for r in records if r.tree_sizes and r.accept_lengths and len(r.tree_sizes) == len(r.accept_lengths)]
    if sized:
        from rasd.decoding.cost import context_bucket

        buckets: dict[str, dict[str, int]] = {}
        for r in sized:
            context = r.prompt_tokens + 1          # the prompt plus the first new token from prefill
            for size, accepted in zip(r.tree_sizes, r.accept_lengths, strict=True):
                hist = buckets.setdefault(str(context_bucket(context)), {})
                hist[str(size + 1)] = hist.get(str(size + 1), 0) + 1
                context += accepted
        out["tree_tokens_by_bucket"] = {b: dict(sorted(h.items(), key=lambda kv: int(kv[0])))
                                        for b, h in sorted(buckets.items(), key=lambda kv: int(kv[0]))}
    return out


def _counts(values: Sequence[int]) -> dict[str, int]:
    """{value: count} with string keys (JSON), in increasing order of value."""
    hist: dict[int, int] = {}
    for v in values:
        hist[v] = hist.get(v, 0) + 1
    return {str(k): hist[k] for k in sorted(hist)}


def _sum_counts(dicts: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for d in dicts:
        for key, n in (d or {}).items():
            total[key] = total.get(key, 0) + int(n)
    return dict(sorted(total.items()))


# ------------------------------------------------------------------------------------------- output


def _fmt(value: float | None, pattern: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, pattern) + suffix


def format_table(results: dict[str, Any]) -> str:
    """A plain-text table: one row per (category, method), the overall rows last."""
    methods = results["methods"]
    categories = sorted({c for entry in methods.values() for c in entry["per_category"]})
    header = (f"{'category':<16} {'method':<12} {'tok/s':>7} {'e2e':>7} {'vs hf':>6} {'med':>6} "
              f"{'vs ar':>6} {'acc':>5} {'match':>5} {'n':>3}")
    lines = [header, "-" * len(header)]
    for cat in [*categories, OVERALL]:
        for name, entry in methods.items():
            s = entry if cat == OVERALL else entry["per_category"].get(cat)
            if s is None:
                continue
            lines.append(_table_row(cat, name, s))
    return "\n".join(lines)


def _table_row(category: str, method: str, s: dict[str, Any]) -> str:
    return (f"{category[:16]:<16} {method[:12]:<12} {_fmt(s['tokens_per_s'], '7.2f'):>7} "
            f"{_fmt(s['e2e_tokens_per_s'], '7.2f'):>7} {_fmt(s['speedup_vs_hf'], '.2f', 'x'):>6} "
            f"{_fmt(s['median_speedup_vs_hf'], '.2f', 'x'):>6} {_fmt(s['speedup_vs_ar'], '.2f', 'x'):>6} "
            f"{_fmt(s['mean_accepted_tokens'], '5.2f'):>5} {_fmt(s['greedy_match_rate'], '5.2f'):>5} "
            f"{s['num_prompts']:>3}")


def answer_row(record: RunRecord, tokenizer: Any, model_id: str) -> dict[str, Any]:
    """One Spec-Bench-style answer line (`choices[0].turns` etc.) plus flat fields for quick reading."""
    text = tokenizer.decode(record.token_ids, skip_special_tokens=True)
    return {"question_id": record.question_id, "category": record.category, "method": record.method,
            "model_id": model_id, "answer": text, "token_ids": record.token_ids,
            "new_tokens": record.new_tokens, "finish_reason": record.finish_reason,
            "wall_time": record.total_time_s, "prefill_time_s": record.prefill_time_s,
            "decode_time_s": record.decode_time_s, "tokens_per_s": record.tokens_per_s,
            "steps": record.steps, "accept_lengths": record.accept_lengths,
            "accepted_by_source": record.accepted_by_source,
            "choices": [{"index": 0, "turns": [text], "decoding_steps": [record.steps],
                         "new_tokens": [record.new_tokens], "wall_time": [record.total_time_s],
                         "accept_lengths": record.accept_lengths}],
            "tstamp": time.time()}


def _atomic_write(path: str | Path, text: str) -> None:
    """Write via a temporary sibling and rename, so a crash never leaves a truncated results file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_results(path: str | Path, results: dict[str, Any]) -> None:
    _atomic_write(path, json.dumps(results, indent=2) + "\n")


def write_answers(path: str | Path, records: Sequence[RunRecord], tokenizer: Any, model_id: str) -> None:
    ordered = sorted(records, key=lambda r: (r.index, r.method))
    _atomic_write(path, "".join(json.dumps(answer_row(r, tokenizer, model_id)) + "\n" for r in ordered))


def plot_speedups(results: dict[str, Any], path: str | Path) -> None:
    """Grouped bars: speedup vs HF greedy (vs `ar` if HF was not run) per category, one bar per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = results["methods"]
    base = "hf" if "hf" in methods else "ar"
    names = [m for m in methods if m != base]
    categories = sorted({c for e in methods.values() for c in e["per_category"]}) + [OVERALL]
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(categories) + 2), 4.5))
    for i, name in enumerate(names):
        entry = methods[name]
        groups = [entry if c == OVERALL else entry["per_category"].get(c, {}) for c in categories]
        values = [g.get(f"speedup_vs_{base}") or 0.0 for g in groups]
        offset = (i - (len(names) - 1) / 2) * width
        bars = ax.bar([x + offset for x in range(len(categories))], values, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    ax.set_ylabel(f"decode speedup vs {base}")
    ax.set_title(f"{results.get('model')} on {results.get('device')} ({results.get('dtype')}), "
                 f"{results.get('max_new_tokens')} new tokens")
    if names:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- CLI


@dataclass
class BenchConfig:
    """Everything a benchmark run needs besides the models and the prompts."""

    methods: list[str]
    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    warmup: bool = True
    progress: bool = True


def run_benchmark(target: LoadedModel, prompts: Sequence[BenchPrompt], config: BenchConfig,
                  draft: LoadedModel | None = None, meta: dict[str, Any] | None = None,
                  ) -> tuple[dict[str, Any], list[RunRecord]]:
    """Build the runners, run them interleaved, and aggregate: the in-process entry point tests use."""
    import torch

    runners = [make_runner(name, target, config.sampling, draft) for name in config.methods]
    records = run_prompts(runners, prompts, config.max_new_tokens, config.sampling, config.warmup,
                          config.progress)
    base_meta = {"model": target.name, "device": target.device, "dtype": target.dtype,
                 "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                 "torch_threads": torch.get_num_threads(), "max_new_tokens": config.max_new_tokens,
                 "draft_model": draft.name if draft is not None else None,
                 "temperature": config.sampling.temperature, "top_p": config.sampling.top_p,
                 "top_k": config.sampling.top_k, "seed": config.sampling.seed, "num_prompts": len(prompts)}
    base_meta.update(meta or {})
    results = build_results(base_meta, records, config.methods, config.sampling.greedy)
    results["cost_curves"] = _used_curves(runners)
    return results, records


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
    """The bench options, shared by `rasd bench` and `python -m rasd.pipelines.bench`."""
    parser.add_argument("--model", default="default", help="hub id, local path, or 'default' (embedded)")
    parser.add_argument("--draft-model", default=None,
                        help="draft model for `draft`, `optree`, `rasd`, `hf-assisted`; `eesd` = the target's "
                             "early-exit self-draft (`optree` uses it by default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--dataset", required=True, help="Spec-Bench question.jsonl or LongBench jsonl")
    parser.add_argument("--task", choices=("generate", "docqa"), default="generate",
                        help="docqa: index each LongBench row's context and ask its question through retrieval")
    parser.add_argument("--index", default=None,
                        help="datastore index for the retrieval methods on every prompt (`rasd index build`)")
    parser.add_argument("--retrieve-k", type=int, default=4, help="docqa: chunks retrieved into the prompt")
    parser.add_argument("--category", action="append", default=None,
                        help="keep only this category (or LongBench dataset); repeatable")
    parser.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma list (default {DEFAULT_METHODS})")
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
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
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


def run_from_args(args: argparse.Namespace) -> int:
    """Load data and models, run, print the table and write the requested files."""
    import torch

    from rasd.decoding.models import load_draft, load_model

    methods = parse_methods(args.methods)
    _validate(args, methods)
    if args.threads:
        torch.set_num_threads(args.threads)
    items = load_items(args.dataset, args.category, args.limit) if args.task == "generate" else []
    target = load_model(args.model, device=args.device, dtype=args.dtype)
    draft = load_draft(args.draft_model, target, getattr(args, "eesd", None))
    prompts = _prompts(args, items, target)
    if not prompts:
        raise ValueError("every prompt was skipped")
    sampling = SamplingConfig(args.temperature, args.top_p, args.top_k, args.seed)
    config = BenchConfig(methods, args.max_new_tokens, sampling, not args.no_warmup, not args.no_progress)
    meta = {"dataset": str(args.dataset), "task": args.task, "index": args.index, "categories": args.category,
            "limit": args.limit, "truncated_prompts": sum(p.truncated_tokens > 0 for p in prompts),
            "skipped_prompts": max(len(items) - len(prompts), 0)}
    results, records = run_benchmark(target, prompts, config, draft, meta)
    print(format_table(results))
    _write_outputs(args, results, records, target)
    return 0


def _prompts(args: argparse.Namespace, items: list[BenchItem], target: LoadedModel) -> list[BenchPrompt]:
    """Tokenised prompts for the task; with --index every prompt drafts from that datastore too."""
    if args.task == "docqa":
        from rasd.pipelines.bench_docqa import prepare_docqa_prompts

        return prepare_docqa_prompts(args.dataset, args.category, args.limit, target, args.max_new_tokens,
                                     args.retrieve_k, _log)
    budget = args.max_prompt_tokens or (target.max_context - args.max_new_tokens)
    prompts = prepare_prompts(items, target.tokenizer, budget, args.long_prompts, not args.no_chat, _log)
    if args.index:
        from rasd.index.store import Index, check_tokenizer
        from rasd.pipelines.bench_docqa import RetrievalScope

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
        from rasd.pipelines.report import write_report

        write_report(results, args.report)
        print(f"report: {Path(args.report) / 'report.md'}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m rasd.pipelines.bench ...`: the same as `rasd bench ...`."""
    parser = argparse.ArgumentParser(prog="rasd bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    from rasd.decoding.models import ModelLoadError

    try:
        return run_from_args(args)
    except (ValueError, FileNotFoundError, ModelLoadError) as exc:
        print(f"rasd bench: error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
