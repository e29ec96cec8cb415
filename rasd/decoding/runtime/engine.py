"""SpeculativeDecoder: prefill, then propose → size → verify → commit until a stop condition.

Stop conditions (EOS, stop strings, a repeated span when asked for, max_new_tokens, the model's context) are
applied inside an accepted block: a step may accept several tokens at once, and nothing past the stop point is
ever emitted. Committed tokens are streamed as soon as a step accepts them, except the newest few that may still
be dropped as a repetition (`runtime.repetition`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from rasd.decoding.drafting.history import ResponseHistory
from rasd.decoding.model import fast_forward
from rasd.decoding.model.features import row_features, shared_tap
from rasd.decoding.model.kernels import fast_kernels, install, prefill_products
from rasd.decoding.model.static_step import StaticRows, StepConfig, shared_rows
from rasd.decoding.proposers import ProposerBase, RecyclingMatrix
from rasd.decoding.proposers.registry import METHODS, DecoderSetup, make_proposer, method_spec
from rasd.decoding.runtime.repetition import RepeatWatch
from rasd.decoding.runtime.stats import DecodeStats
from rasd.decoding.sizing.cost import context_bucket, load_or_measure
from rasd.decoding.sizing.gate import DraftGate
from rasd.decoding.sizing.sizers import CostAwareSizer, FixedSizer, Sizer, make_sizer
from rasd.decoding.step.cache import TreeCache
from rasd.decoding.step.logits import LogitsProcessors
from rasd.decoding.step.sampling import GREEDY, SamplingParams, next_token
from rasd.decoding.step.tree import GRAMMAR, DraftTree
from rasd.decoding.step.verify import Process, Verdict, verify

# a verification step for one request: (tree, sampling, generator, processors) -> (verdict, logits [T, vocab])
VerifyStep = Callable[[DraftTree, SamplingParams, "torch.Generator | None", "Process | None"],
                      tuple[Verdict, torch.Tensor]]


@dataclass
class GenerationOutput:
    """New tokens (EOS included when produced, like HF), the decoded text, why it stopped, statistics."""

    token_ids: list[int]
    text: str | None
    finish_reason: str     # "eos" | "length" | "stop" | "repetition"
    stats: DecodeStats
    # where each of `token_ids` came from: "prefill" (the first token), a draft node's source ("datastore",
    # "documents", "context", "draft", ...) when verification accepted it, or "bonus" (the target's own token)
    token_sources: list[str] = field(default_factory=list)
    plain_step_s: float | None = None   # measured latency of one plain decoding step (cost curve, 1 token)
    logprobs: list[TokenLogprob] | None = None   # per token of `token_ids`, when the request asked for them


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability under the target (raw logits, before penalties and temperature,
    as vLLM reports by default) and the `k` most likely tokens at its position, from the forward that
    verified it: the same numbers plain decoding's forward gives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """logits [n, V] (row i: the distribution `tokens[i]` was chosen from) -> one `TokenLogprob` each."""
    logp = logits[: len(tokens)].float().log_softmax(-1)
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    top_v, top_i = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    return [TokenLogprob(tok, lp, tuple(zip(ids, vals, strict=True)))
            for tok, lp, ids, vals in zip(tokens, chosen, top_i.tolist(), top_v.tolist(), strict=True)]


class _StopChecker:
    """Cuts a block of new tokens at EOS, max_new_tokens, a stop string or a repeated span (`repetition`: the
    window, 0 for off)."""

    def __init__(self, max_new_tokens: int, eos_ids: set[int], stop: list[str], tokenizer: Any,
                 repetition: int = 0):
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.max_new, self.eos_ids, self.stop, self.tokenizer = max_new_tokens, eos_ids, stop, tokenizer
        self.text_end: int | None = None   # where the text is cut when a stop string matched
        self.watch = RepeatWatch(repetition) if repetition else None

    @property
    def held(self) -> int:
        """The newest committed tokens not to show yet: they may still be dropped as a repetition."""
        return self.watch.held if self.watch is not None else 0

    def cut(self, generated: list[int], block: list[int]) -> tuple[list[int], str | None]:
        """The part of `block` to commit after `generated`, and a finish reason if generation ends.

        Token by token, in the order plain decoding would meet them: a stop string completed by a token,
        that token being EOS, the newest tokens repeating a whole window, or the token reaching max_new_tokens,
        whichever comes first. Each token seen here is committed (the watch follows the output).
        """
        out: list[int] = []
        for tok in block:
            out.append(tok)
            if self.stop and self._stop_in(generated, out):
                return out, "stop"
            if tok in self.eos_ids:
                return out, "eos"
            if self.watch is not None and self.watch.push(tok):
                return out, "repetition"
            if len(generated) + len(out) >= self.max_new:
                return out, "length"
        return out, None

    def _stop_in(self, generated: list[int], block: list[int]) -> bool:
        """Whether the text so far contains a stop string (recording where the text is cut)."""
        text = self.tokenizer.decode(generated + block, skip_special_tokens=True)
        hits = [text.find(s) for s in self.stop if s in text]
        if not hits:
            return False
        self.text_end = min(hits)
        return True


class SpeculativeDecoder:
    """Lossless speculative decoding of one request at a time with any proposer."""

    def __init__(self, model: torch.nn.Module, proposer: ProposerBase, *, tokenizer: Any = None,
                 sizer: Sizer | None = None, max_context: int | None = None,
                 method: str | None = None, fast: bool = True, step: StepConfig | None = None):
        """`step`: how verification forwards run (default: the static, graph-captured path on CUDA)."""
        self.model = install(model) if fast else model
        self.fast = fast
        if fast and isinstance(proposer.model, torch.nn.Module):
            install(proposer.model)
        self.proposer = proposer
        if proposer.wants_hidden:
            # the target's forwards hand the proposer its features (`decoding.features`), with the layers it taps
            shared_tap(model, tuple(proposer.feature_layers))
        self.tokenizer = tokenizer
        self.sizer = sizer or FixedSizer()
        self.max_context = max_context or int(getattr(model.config, "max_position_embeddings", 2048))
        self.method = method or proposer.name
        self.device = next(model.parameters()).device
        self.step = step or StepConfig.for_device(self.device)

    def static_rows(self) -> StaticRows | None:
        """A one-row static store for a request (kept across requests, so its graphs are captured once),
        or None when verification runs the dynamic path."""
        if not self.step.applies(self.model):
            return None
        rows = shared_rows(self.model, 1, self.step.graphs)
        rows.in_use = True
        return rows

    def generate(self, prompt_ids: list[int], max_new_tokens: int = 128, sampling: SamplingParams | None = None,
                 eos_token_ids: set[int] | None = None, stop: list[str] | None = None,
                 on_tokens: Callable[[list[int]], None] | None = None, repetition: int = 0) -> GenerationOutput:
        """Decode to completion; `on_tokens` is called with every committed block (streaming)."""
        stream = self.stream(prompt_ids, max_new_tokens, sampling, eos_token_ids, stop, repetition=repetition)
        for block in stream:
            if on_tokens is not None:
                on_tokens(block)
        return stream.output

    def stream(self, prompt_ids: list[int], max_new_tokens: int = 128, sampling: SamplingParams | None = None,
               eos_token_ids: set[int] | None = None, stop: list[str] | None = None,
               logprobs: int | None = None, repetition: int = 0) -> GenerationStream:
        """An iterator of committed token blocks; its `.output` is set when it is exhausted.

        `logprobs`: record every new token's log-probability and this many alternatives (None: none).
        `repetition`: stop once the newest this many tokens repeat an earlier span of the output, dropping them
        (`runtime.repetition`; 0: off)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if len(prompt_ids) >= self.max_context:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {self.max_context}")
        checker = _StopChecker(max_new_tokens, set(eos_token_ids or ()), list(stop or []), self.tokenizer,
                               repetition)
        return GenerationStream(self, list(prompt_ids), sampling or GREEDY, checker, logprobs)


class GenerationStream:
    """One request's decoding state and step loop; iterate it to stream committed token blocks.

    The loop is split into `begin` (prefill), `propose` (draft + size a tree) and `commit` (apply a
    verification verdict), so that a batch decoder can verify the trees of many streams in one forward and
    still run exactly this per-request logic.
    """

    def __init__(self, decoder: SpeculativeDecoder, prompt_ids: list[int], sampling: SamplingParams,
                 checker: _StopChecker, logprobs: int | None = None):
        self.decoder, self.prompt_ids, self.sampling, self.checker = decoder, prompt_ids, sampling, checker
        self.output: GenerationOutput | None = None  # type: ignore[assignment]
        self.stats = DecodeStats(method=decoder.method, prompt_tokens=len(prompt_ids))
        self.gen = None if sampling.greedy else sampling.generator()
        self.processors = LogitsProcessors.for_request(sampling, prompt_ids, decoder.tokenizer)
        self.context: list[int] = []
        self.generated: list[int] = []
        self.reason: str | None = None
        # per committed token, its source (see GenerationOutput.token_sources); append-only where handed out
        # (only a held-back tail is ever dropped, `_release`), so another thread may read the sources of the
        # tokens it has been handed while this one goes on decoding
        self.token_sources: list[str] = []
        self.released = 0                    # generated tokens handed out so far (the rest are held back)
        # per verification step, the sources of the tokens it committed (held back or not); append-only, so a
        # reader may take step k's entry once step k's block was handed out
        self.step_log: list[list[str]] = []
        self.logprobs_k = logprobs
        # per committed token when asked for (`logprobs`): kept like token_sources
        self.token_logprobs: list[TokenLogprob] | None = None if logprobs is None else []
        self.plain_step_s: float | None = None
        self.budget = 0                      # draft nodes the last `propose` allowed (sizer and context)
        self._t_start = 0.0
        self._iter = self._run()

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        return next(self._iter)

    def close(self) -> None:
        """Abandon the request: its loop ends now and frees what it holds (the kept static store)."""
        self._iter.close()

    @torch.inference_mode()
    def _run(self) -> Iterator[list[int]]:
        dec = self.decoder
        cache = TreeCache.for_model(dec.model)
        with fast_kernels(dec.fast):
            first = self.begin(cache)
        yield first
        rows = dec.static_rows() if self.reason is None else None
        try:
            if rows is not None:      # the prompt's K/V move into the static store; prefill stays eager
                rows.add_row(cache)
            verify_step: VerifyStep = rows.verify if rows is not None else (
                lambda tree, params, gen, process: verify(dec.model, cache, tree, params, gen, process))
            while self.reason is None:
                steps = self.stats.steps
                with fast_kernels(dec.fast):   # per step: never held across a yield to the caller
                    block = self.step(verify_step)
                if self.stats.steps > steps:   # one block per step, empty when all it committed is held back
                    yield block
        finally:
            if rows is not None:
                rows.clear()
                rows.in_use = False
        self.finish()

    def step(self, verify_step: VerifyStep) -> list[int]:
        """One propose → verify → commit round on this request's own cache (dynamic or static)."""
        t0 = time.perf_counter()
        tree = self.propose()
        if tree is None:
            return []
        tree = self.size(tree)
        t1 = time.perf_counter()
        verdict, logits = verify_step(tree, self.sampling, self.gen, self.process)
        verify_s = time.perf_counter() - t1
        hidden = row_features(self.decoder.model, 0, len(tree), len(tree))
        return self.commit(tree, verdict, logits, t1 - t0, verify_s, alone_s=verify_s, hidden=hidden)

    def begin(self, cache: TreeCache, cached: int = 0) -> list[int]:
        """Prefill into `cache` (one row) and return the first new token as a block.

        `cached`: the first prompt tokens whose K/V the cache already holds (a prefix-cache hit).
        """
        self.start()
        self.stats.cached_prompt_tokens = cached
        dec = self.decoder
        ids = torch.tensor([self.prompt_ids[cached:]], dtype=torch.long, device=dec.device)
        with prefill_products():   # the same products with or without a prefix hit: bit for bit the same logits
            if cached:   # the lean path runs the rest of the prompt as the same causal kernel (`fast_forward._layer`)
                pos = torch.arange(cached, len(self.prompt_ids), device=dec.device)[None]
                logits = fast_forward.forward(dec.model, cache, ids, pos, last_only=True)[0, -1]
            else:
                logits = fast_forward.prefill(dec.model, cache, ids)
        self.feed_features(cached, row_features(dec.model))
        return self.first_token(logits)

    def feed_features(self, start: int, hidden: torch.Tensor | None) -> None:
        """Hand the target's features [n, H] of positions start.. to a proposer that drafts from them (EAGLE)."""
        proposer = self.decoder.proposer
        if hidden is not None and proposer.wants_hidden:
            proposer.observe_hidden(start, hidden)

    def start(self) -> None:
        """The request starts (its clock, its proposer); its prompt is prefilled next, here or by a batch."""
        self._t_start = time.perf_counter()
        self.decoder.proposer.start(self.prompt_ids, self.sampling)

    def first_token(self, logits: torch.Tensor) -> list[int]:
        """The first new token from the prompt's last-position logits [vocab], as a block."""
        raw = logits
        if self.processors is not None:
            logits = self.processors.apply(logits, self.prompt_ids)
        first = next_token(logits.float(), self.sampling, self.gen)
        self._record_logprobs(raw[None], [first])
        self.context, self.generated = self.prompt_ids + [first], [first]
        self.token_sources += ["prefill"]
        _, self.reason = self.checker.cut([], [first])
        self.stats.prefill_time_s = time.perf_counter() - self._t_start
        return self._release()

    @property
    def process(self) -> Process | None:
        """This request's penalties / bias for the verifier, applied per node from the committed context and
        the node's own path (`decoding.logits`); None when it asks for none."""
        processors = self.processors
        if processors is None:
            return None
        return lambda tree, logits: processors.apply(logits, self.context, tree)

    def propose(self) -> DraftTree | None:
        """The proposer's tree for the next step (root = last committed token), within the sizer's budget and
        the model's context; None when the request has reached the context and must stop. Uncut: `size`
        cuts it alone, or a batch sizes it with the other rows' trees (`sizing.batch`)."""
        dec = self.decoder
        if len(self.context) >= dec.max_context:
            self.reason = "length"
            return None
        room = dec.max_context - len(self.context) - 1
        self.budget = budget = max(min(dec.sizer.budget(len(self.context)), room), 0)
        self.plain_step_s = dec.sizer.plain_step_s(len(self.context))
        tree = dec.proposer.propose(self.context, budget) if budget > 0 else DraftTree.root_only(self.context[-1])
        self.stats.pruned_nodes += tree.pruned
        if budget > 0 and self.processors is not None and self.sampling.grammar is not None:
            for rank, path in enumerate(self.processors.forced_tokens(self.context, vocab_size(dec.model))):
                tree.add_path(0, path[:budget], GRAMMAR, [1.0 / (rank + 1)] * len(path[:budget]))
        return tree

    def size(self, tree: DraftTree) -> DraftTree:
        """This request's sizer cuts its tree to what pays on its own (then to the step's budget)."""
        return self.decoder.sizer.cut(tree, len(self.context)).top_nodes(self.budget)

    def commit(self, tree: DraftTree, verdict: Verdict, logits: torch.Tensor, draft_s: float,
               verify_s: float, alone_s: float | None, hidden: torch.Tensor | None = None) -> list[int]:
        """Apply a verdict: cut at stop conditions, record statistics, let proposer and sizer learn.

        `verify_s`: this request's share of the verification forward (statistics). `alone_s`: the time of a
        forward that verified this tree alone, which teaches the sizer what a tree of this size costs; None
        when the forward was shared with other rows (its time says nothing about one tree). `hidden`: the
        target's features [T, H] of the tree's nodes (`decoding.features`), for proposers that read them.
        """
        dec, stats = self.decoder, self.stats
        t2 = time.perf_counter()
        if hidden is not None:   # the root and the accepted nodes now have the target's features
            self.feed_features(len(self.context) - 1, hidden[[0, *verdict.accepted]])
        block, self.reason = self.checker.cut(self.generated, verdict.new_tokens(tree))
        sources = [tree.sources[i] for i in verdict.accepted]
        stats.record_step(tree.sources[1:], sources, tree.num_draft_tokens, max(tree.depths()))
        self._record_logprobs(logits[[0, *verdict.accepted]], block)
        self.step_log.append((sources + ["bonus"])[: len(block)])   # a stop condition may have cut the block
        self.token_sources += self.step_log[-1]
        self.context += block
        self.generated += block
        dec.proposer.observe(self.context, tree, verdict, logits)
        released = self._release()
        overhead = draft_s + (time.perf_counter() - t2)
        dec.sizer.observe(tree, verdict.accepted, overhead, verify_s=alone_s)
        stats.draft_time_s += draft_s
        stats.verify_time_s += verify_s
        stats.bookkeeping_time_s += time.perf_counter() - t2
        return released

    def _release(self) -> list[int]:
        """The committed tokens to hand out now: all but those still held back as a possible repetition; when
        the repetition rule fired, its repeated window is dropped first (never handed out: it was held)."""
        if self.reason == "repetition":
            drop = len(self.generated) - self.checker.watch.window
            del self.generated[drop:]
            del self.context[len(self.context) - self.checker.watch.window:]
            del self.token_sources[drop:]
            if self.token_logprobs is not None:
                del self.token_logprobs[drop:]
        end = len(self.generated) - (self.checker.held if self.reason is None else 0)
        block = self.generated[self.released:end]
        self.released = max(end, self.released)
        return block

    def _record_logprobs(self, logits: torch.Tensor, block: list[int]) -> None:
        """Log-probabilities of a committed block from the rows [n, V] its tokens were chosen from."""
        if self.token_logprobs is not None and block:
            self.token_logprobs += token_logprobs(logits, block, self.logprobs_k or 0)

    def finish(self) -> GenerationOutput:
        """Close the statistics and build the output (called once the loop ends)."""
        self._remember()
        stats = self.stats
        stats.new_tokens = len(self.generated)
        stats.finish_reason = self.reason or "length"
        stats.total_time_s = time.perf_counter() - self._t_start
        self.output = GenerationOutput(token_ids=self.generated, text=self._text(self.generated),
                                       finish_reason=stats.finish_reason, stats=stats,
                                       token_sources=list(self.token_sources), plain_step_s=self.plain_step_s,
                                       logprobs=None if self.token_logprobs is None else list(self.token_logprobs))
        return self.output

    def _remember(self) -> None:
        """A request that ended normally (EOS, stop, length) joins its proposer's response history, if it has
        one: the next similar question drafts from this answer (SuffixDecoding). Abandoned requests never get
        here (`close` ends the loop before `finish`)."""
        history = self.decoder.proposer.history
        if isinstance(history, ResponseHistory) and self.reason is not None and self.generated:
            history.add(self.prompt_ids[-history.prompt_tail:] if history.prompt_tail else [], self.generated)

    def _text(self, generated: list[int]) -> str | None:
        tok = self.decoder.tokenizer
        if tok is None:
            return None
        text = tok.decode(generated, skip_special_tokens=True)
        return text[: self.checker.text_end] if self.checker.text_end is not None else text


def build_decoder(target: Any, method: str, draft: Any = None, datastores: list[Any] | None = None,
                  sizing: str = "cost", max_nodes: int = 64, heartbeat: Callable[[], None] | None = None,
                  **proposer_options: Any) -> SpeculativeDecoder:
    """A decoder for a LoadedModel and a method name, with cost-aware sizing against its measured curve.

    `sizing` names the tree-size policy (`sizing.sizers.SIZINGS`): `cost` (default) against the target's
    measured cost curve, `fixed` (up to `max_nodes` nodes by proposer score), `heuristic`, `threshold`,
    `thompson` or `ldlp` (a trained predictor: option `ldlp=` or $RASD_HOME/ldlp/). What a method needs and
    the options cost sizing gives it come from its `MethodSpec` (`proposers.registry`). `datastores` (token
    suffix arrays) feed the methods that use the index; methods that read the target's Token Recycling
    matrix get the shared one passed as `recycling=` (hot start), else their own, empty one; likewise methods
    that draft from earlier responses get `history=` (a `ResponseHistory`; `history=False` turns it off).
    `heartbeat`: called while a cost curve is measured on first use (a scheduler's stall detector).
    """
    spec = method_spec(method)
    if spec.uses_recycling:
        proposer_options.setdefault("recycling", RecyclingMatrix(vocab_size(target.model)))
    if spec.uses_history:   # the caller's shared history (a service keeps one per index), else an empty one
        proposer_options.setdefault("history", ResponseHistory())
    curve_for = _curve_provider(target, heartbeat)   # lazy: nothing is measured unless a policy asks for the curve
    drafter = spec.ldlp_drafter(None if draft is None else draft.name)
    setup = DecoderSetup(target, draft, sizing, proposer_options, curve_for)
    if spec.configure is not None:
        spec.configure(setup)
    if spec.gates_draft(None if draft is None else draft.name) and sizing == "cost":
        # drafts are paid for before the sizer can drop them: decide per step whether drafting pays at all
        proposer_options.setdefault("gate", DraftGate(block=spec.gate_block))
    if proposer_options.get("gate") is False:            # `gate=off`: the sizer alone decides every step
        proposer_options["gate"] = None
    if proposer_options.get("gate") is True:             # `gate=on`: a gate where the method has none by default
        if spec.gate_block is None:
            raise ValueError(f"method {method!r} runs no draft model: it has no draft gate to turn on")
        proposer_options["gate"] = DraftGate(block=spec.gate_block)
    single_node = proposer_options.pop("single_node", spec.defaults().get("single_node", False))
    if single_node is True and "single_node" not in spec.defaults():
        armed = ", ".join(f"`{m}`" for m, other in METHODS.items() if "single_node" in other.defaults())
        raise ValueError(f"method {method!r} has no one-node arm to turn on (only {armed} have one)")
    sizer_options: dict[str, Any] = {}
    if sizing == "ldlp":
        sizer_options = {"target": target.model, "model_name": target.name, "drafter": drafter,
                         "path": (proposer_options.get("ldlp") if spec.needs_ldlp
                                  else proposer_options.pop("ldlp", None))}
    draft = setup.draft
    proposer = make_proposer(method, draft_model=None if draft is None else draft.model, datastores=datastores,
                             **proposer_options)
    sizer: Sizer = (make_sizer(sizing, max_nodes, curve_for=curve_for, **sizer_options) if spec.speculates
                    else FixedSizer(0))
    proposer.use_sizer(sizer)   # a model drafter stops growing where the sizer says a layer cannot pay
    if single_node and isinstance(sizer, CostAwareSizer):
        sizer.use_single_node_arm()
    return SpeculativeDecoder(target.model, proposer, tokenizer=target.tokenizer, sizer=sizer,
                              max_context=target.max_context, method=method, step=getattr(target, "step", None))


def vocab_size(model: torch.nn.Module) -> int:
    """Rows of the LM head: the ids the target can emit (config.vocab_size may be smaller or padded)."""
    head = model.get_output_embeddings()
    return int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)


def _curve_provider(target: Any, heartbeat: Callable[[], None] | None = None) -> Callable[[int], Any]:
    """Memoised context length → cost curve for this target (measured once per bucket, cached on disk)."""
    memo: dict[int, Any] = {}

    def curve_for(context_len: int) -> Any:
        bucket = context_bucket(context_len)
        if bucket not in memo:
            memo[bucket] = load_or_measure(target.model, target.name, target.device, target.dtype, context_len,
                                           step=getattr(target, "step", None), heartbeat=heartbeat)
        return memo[bucket]

    return curve_for
