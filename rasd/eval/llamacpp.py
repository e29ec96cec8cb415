"""The llama.cpp baseline of `rasd bench --methods llamacpp`: plain decoding of the model's GGUF file through
llama-cpp-python (`llama_cpp.Llama`), fed the very prompt token ids every other method decodes.

Why: users compare us with llama.cpp on the file our embedded model is converted from. What it measures is
llama.cpp's own kernels on the quantized weights (Q4_1 for the embedded model) with the activations quantized to
8 bits for the products, so its greedy tokens may leave our fp32 `ar` where two logits are close; the match column
shows that as it is. llama-cpp-python is an optional extra (a ~10 minute source build), imported only when the
method is asked for.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from rasd.eval.datasets import BenchPrompt
from rasd.eval.runners import LLAMACPP, RepeatCut, RunRecord, SamplingConfig
from rasd.paths import DEFAULT_MODEL

INSTALL_HINT = ("llamacpp needs llama-cpp-python: pip install 'rasd[llamacpp]' "
                "(builds llama.cpp from source, ~10 min)")


def require_llama_cpp() -> ModuleType:
    """The `llama_cpp` module, or the one-line install hint: checked with the arguments, before any model loads."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise ValueError(INSTALL_HINT) from exc
    return llama_cpp


def check_method(name: str) -> None:
    """`llamacpp` takes no `:KEY=VALUE` options: it runs the GGUF's own quantization, in llama.cpp's own way."""
    if name != LLAMACPP:
        raise ValueError(f"{name}: {LLAMACPP} takes no options (it runs the GGUF file as llama.cpp does)")


def resolve_gguf(model: str, gguf: str | None) -> Path:
    """The GGUF file llamacpp runs: `--gguf` when given, else the embedded model's own file for `--model default`.

    Another model has no GGUF we could find (or trust to be the same weights), so it must be named."""
    if gguf:
        path = Path(gguf).expanduser()
        if not path.is_file():
            raise ValueError(f"--gguf {gguf}: no such file")
        return path
    if model != DEFAULT_MODEL:
        raise ValueError(f"{LLAMACPP} on --model {model} needs --gguf PATH (that model's GGUF file)")
    from rasd.decoding.model.loading import find_gguf

    return find_gguf()


def sampling_kwargs(sampling: SamplingConfig) -> dict[str, Any]:
    """`Llama.generate` settings for the bench's sampling: greedy is temperature 0 (llama.cpp's greedy sampler) with
    top-k 1; sampling passes temperature, top-p and top-k (0 = off in both). Its extra filters are switched off
    (min-p defaults to 0.05 there, repetition penalty 1 = none).

    Note: llama.cpp filters top-k and top-p before it divides by the temperature, HF and our engine after; with
    top-p < 1 and a temperature other than 1 the sampled distributions are not the same."""
    off = {"min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
    if sampling.greedy:
        return {**off, "temp": 0.0, "top_k": 1, "top_p": 1.0}
    return {**off, "temp": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}


class LlamaCppRunner:
    """Plain decoding through llama.cpp, timed like the `hf` baseline (prefill + decode, each first token's arrival).

    The `Llama` is loaded on first use with a context for the longest prompt + `max_new_tokens` (`prepare` sizes it
    for the whole bench, so no load happens inside a timed run)."""

    def __init__(self, gguf: Path, sampling: SamplingConfig, eos_ids: Iterable[int], n_threads: int,
                 gpu: bool = False, vocab_size: int | None = None, repetition: int = 0) -> None:
        self.name = LLAMACPP
        self.gguf = Path(gguf)
        self.sampling = sampling
        self.eos_ids = {int(e) for e in eos_ids}
        self.n_threads = n_threads
        self.gpu = gpu                      # --device cuda: offload every layer (a CPU-only build ignores it)
        self.vocab_size = vocab_size        # the target's, to refuse a GGUF of another tokenizer
        self.repetition = repetition        # the repetition stop's window (0: off), cut as the engine cuts
        self.llm: Any = None

    @property
    def meta(self) -> dict[str, Any]:
        """What results.json records about this baseline: the file, the library's version, its threads."""
        return {"gguf": str(self.gguf), "llamacpp_version": require_llama_cpp().__version__,
                "llamacpp_threads": self.n_threads}

    def prepare(self, prompts: Sequence[BenchPrompt], max_new_tokens: int) -> None:
        if prompts:
            self._model(max(len(p.input_ids) for p in prompts) + max_new_tokens)

    def _model(self, n_ctx: int) -> Any:
        """The loaded `Llama`, (re)loaded when its context is shorter than `n_ctx` tokens."""
        if self.llm is not None and self.llm.n_ctx() >= n_ctx:
            return self.llm
        if self.llm is not None:
            self.llm.close()
        llama_cpp = require_llama_cpp()
        self.llm = llama_cpp.Llama(model_path=str(self.gguf), n_ctx=n_ctx, n_threads=self.n_threads,
                                   n_threads_batch=self.n_threads, n_gpu_layers=-1 if self.gpu else 0,
                                   verbose=False)
        if self.vocab_size is not None and self.llm.n_vocab() != self.vocab_size:
            raise ValueError(f"{self.gguf} has {self.llm.n_vocab()} tokens, the model {self.vocab_size}: "
                             "not the same tokenizer")
        return self.llm

    def run(self, prompt_ids: list[int], max_new_tokens: int, seed: int | None) -> RunRecord:
        llm = self._model(len(prompt_ids) + max_new_tokens)
        llm.reset()   # no KV reuse from the last run's matching prefix: every prompt pays its prefill, as in `hf`
        if seed is not None:
            llm.set_seed(seed)
        start = time.perf_counter()
        stream = llm.generate(list(prompt_ids), reset=True, **sampling_kwargs(self.sampling))
        cut = RepeatCut(self.repetition, self.eos_ids) if self.repetition else None
        try:
            tokens, finish, first = read_tokens(stream, self.eos_ids, max_new_tokens, cut)
        finally:
            stream.close()
        end = time.perf_counter()
        return plain_record(tokens, self.eos_ids, start, first if first is not None else end, end, finish)


def read_tokens(stream: Iterable[int], eos_ids: set[int], max_new_tokens: int,
                cut: RepeatCut | None = None) -> tuple[list[int], str, float | None]:
    """Take a plain decoder's tokens until EOS, the repetition stop or `max_new_tokens`, checked per token in the
    engine's order: (the tokens, the repeated window dropped when the rule fired; finish reason; first token's
    arrival time)."""
    tokens: list[int] = []
    first: float | None = None
    for token in stream:
        if first is None:
            first = time.perf_counter()
        tokens.append(int(token))
        if tokens[-1] in eos_ids:
            return tokens, "eos", first
        if cut is not None and cut.feed(tokens):
            return cut.cut(tokens)[0], "repetition", first
        if len(tokens) >= max_new_tokens:
            break
    return tokens, "length", first


def plain_record(tokens: list[int], eos_ids: set[int], start: float, first: float, end: float,
                 finish: str | None = None) -> RunRecord:
    """A plain decoder's record: the first token comes from prefill, each later one from one forward."""
    steps = max(len(tokens) - 1, 0)
    finish = finish or ("eos" if tokens and tokens[-1] in eos_ids else "length")
    return RunRecord(method=LLAMACPP, index=-1, question_id="", category="", token_ids=tokens,
                     finish_reason=finish, prefill_time_s=first - start, decode_time_s=end - first,
                     total_time_s=end - start, decode_tokens=steps, steps=steps,
                     mean_accepted_tokens=1.0 if steps else None, accept_lengths=[1] * steps)


def first_differences(records: Sequence[RunRecord], reference: str) -> list[dict[str, Any]]:
    """Per prompt, the first token where llamacpp leaves the greedy reference (None: the same tokens).

    Why beside the match column: a quantized model's greedy output leaves fp32's at some near-tie, and how early
    it does so is the informative part; a bare 0.00 match hides it."""
    from rasd.eval.near_ties import first_difference

    refs = {r.index: r for r in records if r.method == reference}
    return [{"question_id": r.question_id, "category": r.category,
             "position": first_difference(r.token_ids, refs[r.index].token_ids)}
            for r in records if r.method == LLAMACPP and r.index in refs]


def format_first_differences(rows: Sequence[dict[str, Any]], reference: str) -> str:
    """One line for the terminal, after the table."""
    same = sum(row["position"] is None for row in rows)
    where = [f"{row['category']}#{row['question_id']} at token {row['position']}" for row in rows
             if row["position"] is not None]
    return (f"{LLAMACPP} vs {reference}: the same tokens on {same} of {len(rows)} prompts"
            + (f"; first different token: {', '.join(where)}" if where else ""))
