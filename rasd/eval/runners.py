"""Benchmark runners: HF `generate` baselines and our engine, one `RunRecord` per (method, prompt); the llama.cpp
baseline's runner is in `llamacpp.py`.

Methods run interleaved prompt by prompt (their order rotating) after one untimed warm-up each, so that drift
of a noisy shared machine hits all methods alike. Speed is the decode phase (tokens after the first new one
over the time after it arrived); `e2e_tokens_per_s` includes prefill. For HF the first token's arrival is
taken from a streamer.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rasd.eval.datasets import BenchPrompt

if TYPE_CHECKING:
    from rasd.decoding.model.loading import LoadedModel

HF_METHODS = ("hf", "hf-static", "hf-pld", "hf-assisted")
LLAMACPP = "llamacpp"   # llama.cpp on the model's GGUF (`eval/llamacpp.py`; the bench builds it: it needs the file)
BASELINES = (*HF_METHODS, LLAMACPP)
HF_PLD_NUM_TOKENS = 10  # HF's prompt-lookup window, the value Spec-Bench and the HF docs use
WARMUP_MAX_NEW_TOKENS = 16

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


class RepeatCut:
    """The engine's repetition stop (`decoding.runtime.repetition`) for a baseline that decodes without it (HF
    `generate`, llama.cpp): it follows the output token by token, in the engine's order (EOS ends the answer before
    the rule sees it), and cuts where the engine would, so `--stop-on-repetition` compares the same answers.

    `feed` takes the whole new output so far and reads only what it has not seen (cheap per step, also when a step
    adds several tokens); tokens decoded after the rule fired are dropped with the repeated window."""

    def __init__(self, window: int, eos_ids: Iterable[int]) -> None:
        from rasd.decoding.runtime.repetition import RepeatWatch

        self.watch = RepeatWatch(window)
        self.eos_ids = {int(e) for e in eos_ids}
        self.seen = 0
        self.done = False
        self.fired_at: int | None = None     # the number of new tokens after which the rule fired

    def feed(self, new_tokens: Sequence[int]) -> bool:
        """Follow the output up to its current length; True once the rule has fired (stop decoding)."""
        while not self.done and self.seen < len(new_tokens):
            token = int(new_tokens[self.seen])
            self.seen += 1
            if token in self.eos_ids:
                self.done = True
            elif self.watch.push(token):
                self.done, self.fired_at = True, self.seen
        return self.fired_at is not None

    def cut(self, tokens: Sequence[int]) -> tuple[list[int], bool]:
        """`tokens` as the engine leaves them: up to where the rule fired, minus the repeated window; and whether
        it fired."""
        if self.fired_at is None:
            return list(tokens), False
        return list(tokens[: self.fired_at - self.watch.window]), True


def _repeat_criteria_class() -> type:
    """Build the StoppingCriteria lazily so importing this module does not import transformers."""
    from transformers import StoppingCriteria

    class RepeatCriteria(StoppingCriteria):
        """Stops HF `generate` (one row) once its RepeatCut fires; the cut itself is made after `generate`."""

        def __init__(self, cut: RepeatCut, prompt_len: int) -> None:
            self.repeat_cut, self.prompt_len = cut, prompt_len

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            import torch

            fired = self.repeat_cut.feed(input_ids[0, self.prompt_len:].tolist())
            return torch.full((input_ids.shape[0],), fired, dtype=torch.bool, device=input_ids.device)

    return RepeatCriteria


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
    """HF `generate` baselines: `hf` (plain), `hf-static` (HF's fast path: a static cache, whose decode step
    `generate` compiles on CUDA), `hf-pld` (prompt lookup), `hf-assisted` (draft model)."""

    def __init__(self, name: str, target: LoadedModel, sampling: SamplingConfig,
                 draft: LoadedModel | None = None, repetition: int = 0) -> None:
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
        self.static_cache: Any = None     # hf-static: one cache of a fixed length for every prompt
        self.repetition = repetition      # the repetition stop's window (0: off), applied as the engine applies it

    def _generate_kwargs(self, max_new_tokens: int) -> dict[str, Any]:
        """Stopping and decoding settings identical to what our engine gets."""
        kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "eos_token_id": self.eos_ids,
                                  "pad_token_id": self.pad_id, "min_new_tokens": 0}
        if self.sampling.greedy:
            kwargs["do_sample"] = False
        else:
            kwargs.update(do_sample=True, temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                          top_k=self.sampling.top_k)
        if self.name == "hf-static" and self.static_cache is not None:
            from rasd.decoding.step.cache import cache_kwargs

            self.static_cache.reset()
            kwargs.update(cache_kwargs(self.target.model, self.static_cache))
        elif self.name == "hf-static":
            kwargs["cache_implementation"] = "static"
        if self.name == "hf-pld":
            kwargs["prompt_lookup_num_tokens"] = HF_PLD_NUM_TOKENS
        elif self.name == "hf-assisted":
            kwargs["assistant_model"] = self.draft.model
        return kwargs

    def prepare(self, prompts: Sequence[BenchPrompt], max_new_tokens: int) -> None:
        """hf-static: one static cache long enough for every prompt. Why fixed: `generate` sizes a static
        cache per call (prompt + max_new_tokens), and every new length would compile the step again."""
        if self.name != "hf-static" or not prompts:
            return
        from transformers.cache_utils import StaticCache

        longest = max(len(p.input_ids) for p in prompts) + max_new_tokens
        self.static_cache = StaticCache(config=self.target.model.config, max_cache_len=longest)

    def run(self, prompt_ids: list[int], max_new_tokens: int, seed: int | None) -> RunRecord:
        import torch

        model = self.target.model
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.target.device)
        streamer = self.streamer_cls(self.target.device)
        kwargs = self._generate_kwargs(max_new_tokens)
        cut = RepeatCut(self.repetition, self.eos_ids) if self.repetition else None
        if cut is not None:
            from transformers import StoppingCriteriaList

            kwargs["stopping_criteria"] = StoppingCriteriaList([_repeat_criteria_class()(cut, len(prompt_ids))])
        if seed is not None:
            torch.manual_seed(seed)
        with torch.inference_mode(), plain_generation_config(model, self.eos_ids, self.pad_id):
            _sync(self.target.device)
            start = time.perf_counter()
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), streamer=streamer, **kwargs)
            _sync(self.target.device)
            end = time.perf_counter()
        token_ids = out[0, len(prompt_ids):].tolist()
        fired = False
        if cut is not None:
            cut.feed(token_ids)        # the criteria saw every step but the last (`generate` may end by length)
            token_ids, fired = cut.cut(token_ids)
        record = _hf_record(self.name, token_ids, self.eos_ids, streamer.first_token_time, streamer.chunks,
                            start, end)
        if fired:
            record.finish_reason = "repetition"
        return record


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
                 draft: LoadedModel | None = None, repetition: int = 0) -> None:
        from rasd.decoding.proposers.registry import method_variant
        from rasd.decoding.runtime.engine import build_decoder

        self.name = name
        self.target = target
        self.sampling = sampling
        self.eos_ids = set(target.eos_token_ids)
        method, options = method_variant(name)
        self.decoder = build_decoder(target, method, draft=draft, **options)
        self.curves: dict[str, Any] = {}       # cost curves the sizer used, by key (for the report)
        self.repetition = repetition           # the engine's repetition stop window (0: off)

    def after_warmup(self) -> None:
        """Forget the warm-up's answer: a response history would draft the first prompt from it."""
        history = self.decoder.proposer.history
        if history is not None:
            history.clear()

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
        proposer.set_datastores(scope.datastores)
        proposer.scope(scope.scope_docs or None)

    def run(self, prompt_ids: list[int], max_new_tokens: int, seed: int | None) -> RunRecord:
        from rasd.decoding.step.sampling import SamplingParams

        params = SamplingParams(temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                                top_k=self.sampling.top_k, seed=seed)
        _sync(self.target.device)
        start = time.perf_counter()
        out = self.decoder.generate(prompt_ids, max_new_tokens=max_new_tokens, sampling=params,
                                    eos_token_ids=self.eos_ids, repetition=self.repetition)
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
                         tree_depths=list(stats.tree_depths),
                         drafted_by_source=dict(stats.drafted_by_source))




def make_runner(name: str, target: LoadedModel, sampling: SamplingConfig,
                draft: LoadedModel | None = None, repetition: int = 0) -> Runner:
    """HF baselines by name; every other name is one of our engine's methods. `METHOD:dtype=D` runs the method on
    the target loaded in dtype D (`rasd:dtype=float32` beside `rasd`), its records under the full name.
    `repetition`: the repetition stop's window for every runner (0: off)."""
    base, dtype = split_dtype(name)
    if base == LLAMACPP:
        raise ValueError(f"{LLAMACPP} runs a GGUF file: build it with rasd.eval.llamacpp.LlamaCppRunner")
    if dtype is not None and dtype != target.dtype:
        runner = make_runner(base, target_in(target, dtype), sampling, draft, repetition)
        return DtypeVariant(name, runner)
    if base in HF_METHODS:
        return HFRunner(base, target, sampling, draft, repetition)
    return EngineRunner(base, target, sampling, draft, repetition)


def split_dtype(name: str) -> tuple[str, str | None]:
    """`rasd:dtype=float32;history=off` -> ("rasd:history=off", "float32"); the dtype is the bench's, not the
    method's."""
    method, sep, rest = name.partition(":")
    if not sep:
        return name, None
    dtype, kept = None, []
    for pair in filter(None, rest.split(";")):
        key, _, value = pair.partition("=")
        if key == "dtype":
            dtype = value
        else:
            kept.append(pair)
    return (f"{method}:{';'.join(kept)}" if kept else method), dtype


_TARGETS: dict[tuple[str, str, str], LoadedModel] = {}


def target_in(target: LoadedModel, dtype: str) -> LoadedModel:
    """The same model in another dtype, loaded once per bench process."""
    from rasd.decoding.model.loading import load_model

    key = (target.name, target.device, dtype)
    if key not in _TARGETS:
        _TARGETS[key] = load_model(target.name, device=target.device, dtype=dtype, graphs=target.graphs)
    return _TARGETS[key]


class DtypeVariant:
    """A runner on the target in another dtype whose records carry the variant's full name."""

    def __init__(self, name: str, inner: Runner) -> None:
        self.name = name
        self.inner = inner

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    def run(self, prompt_ids: list[int], max_new_tokens: int, seed: int | None) -> RunRecord:
        record = self.inner.run(prompt_ids, max_new_tokens, seed)
        record.method = self.name
        return record


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
            if hasattr(runner, "after_warmup"):
                runner.after_warmup()
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
