"""`rasd`: retrieval (datastore + scoped documents + context) pruned and fused with a draft model's tree.

Each step (arXiv 2503.03434): the retrieval tree is built (`RetrievalProposer`), its branches are pruned by
the draft model's next-token probabilities and their retrieval counts, the draft model proposes its own
tree, and the kept retrieval paths are grafted into it by longest-prefix matching within the node budget;
the target verifies the fused tree once. Nodes keep their source ("draft", "datastore", "documents",
"context"; a token proposed by both the draft and retrieval is tagged with the retrieval source, so the
draft is credited with what it alone adds: `fusion.fuse`), so statistics show whose tokens got accepted, and
`DecodeStats.pruned_nodes` counts what pruning removed.

A fourth source is Token Recycling (`recycling`): the target's own top-k recycled from earlier
verifications. Its tree is fused last, filling whatever budget the other sources leave (it always has a
guess, where retrieval often has none), and without a draft model its recycled root distribution is the
probability source that prunes retrieval branches (`prune_with="recycling"`). Without a draft model or a
recycling matrix the retrieval branches are pruned by retrieval counts alone, unless a `probs_fn` (any
`context -> next-token probabilities [vocab]`) is given.

A fifth source is the response history (`history`, SuffixDecoding, arXiv 2411.04975): earlier answers of
this service, looked up by the context's longest suffix (`SuffixProposer.candidate_tree`, tagged "history",
sized by SuffixDecoding's match-length and probability rules). It is fused right after the request's own text
and before the datastore: a long match there is an earlier answer to the same question being repeated, more
specific than a match in the whole index, while the request's own text stays first (it is what the answer
quotes). The engine adds every finished response to `self.history`.

The draft may run elsewhere: `draft_proposer=` takes an already-built draft proposer, such as a
`RemoteDraft` whose model lives in a `DraftWorker` Ray actor; when it answers "no draft" (worker down or
late), the step goes on with the retrieval and recycled trees, pruned by counts.

Sampling stays exact: the draft tree (whose nodes were sampled from q) is built first and kept whole;
retrieval nodes are deterministic candidates grafted after the sampled ones (see `fusion`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rasd.decoding.drafting.fusion import ProbsFn, PruneConfig, fuse, merge_trees, prune
from rasd.decoding.proposers.base import ProposerBase
from rasd.decoding.proposers.draft import DraftModelProposer
from rasd.decoding.proposers.recycling import SOURCE as RECYCLED
from rasd.decoding.proposers.recycling import RecyclingMatrix, RecyclingProposer
from rasd.decoding.proposers.retrieval import CONTEXT, DATASTORE, DOCUMENTS, RetrievalProposer, match_class
from rasd.decoding.proposers.short_copies import ShortCopies
from rasd.decoding.proposers.suffix import HISTORY, SuffixProposer
from rasd.decoding.sizing.gate import DraftGate
from rasd.decoding.step.sampling import SamplingParams
from rasd.decoding.step.tree import GRAMMAR, ROOT, DraftTree
from rasd.decoding.step.verify import Verdict

# The shortest match of the request's own text that `rasd` copies from when it has a drafter (without one: 1, as
# `pld`). Why: a one-token match offers a bush of continuations that are rarely right, and it takes the step from
# the drafter (the copying sources get their budget first, and the draft gate decides per match class); measured
# faster with the EAGLE head (docs/methods.md, "Which sources `rasd` uses").
CONTEXT_MIN_NGRAM_WITH_DRAFT = 2

# The shortest match in the response history that `rasd` drafts from when it has a drafter (without one: 1, as
# SuffixDecoding). Why: the history is there for answers being repeated, which match long; beside the EAGLE head a
# 1-3 token match was right 12% of the time against the head's 29%, and it counted as a match, so the draft gate
# ran steps without the head (docs/lab-notes/eagle.md, 2026-12-06, fifth session).
HISTORY_MIN_MATCH_WITH_DRAFT = 4

# Every source but the drafter's (whatever its tag: "draft", "eagle", or a draft worker's): the root, the
# copying and recycled sources, and the tokens a grammar forces (added by the engine after `propose`).
FREE_SOURCES = frozenset({ROOT, CONTEXT, DATASTORE, DOCUMENTS, HISTORY, RECYCLED, GRAMMAR})

if TYPE_CHECKING:   # the index package may pull in heavy deps (FAISS); import it lazily
    from rasd.decoding.drafting.history import ResponseHistory
    from rasd.index.suffix_array import SuffixArray


@dataclass
class RasdConfig:
    """`rasd`'s knobs (the objects it drafts from are `RasdProposer`'s own arguments). Defaults are the shipped
    behaviour; `build_decoder` fills `flat_curve` and `draft_options` from the measured cost curve."""

    # which probabilities prune the retrieval branches: "auto" (the draft's, else counts), "draft", "recycling"
    # or "counts" (`_probability_source` says why recycled ones are not the default)
    prune_with: str = "auto"
    # how many retrieval branches survive pruning, and by which thresholds
    prune_config: PruneConfig = field(default_factory=PruneConfig)
    # any `context -> next-token probabilities [vocab]` to prune with instead of `prune_with`'s source
    probs_fn: ProbsFn | None = None
    # context length -> whether the target's cost curve is flat there: recycled tokens then join every step
    # (extra nodes are nearly free); None: only as a fallback, on steps where no other source has a guess
    flat_curve: Callable[[int], bool] | None = None
    # one-token copies of the request's own text, scored per request (`ShortCopies`), beside a drafter
    short_copies: bool = True
    # the shortest match of the request's own text to copy from; None: 2 with a drafter, else 1 (as `pld`)
    context_min_ngram: int | None = None
    # `DraftConfig` fields of the local draft's `DraftModelProposer` (none with `draft_proposer`); a dict, as
    # draft workers get theirs
    draft_options: dict[str, Any] = field(default_factory=dict)
    # options of the recycled tree's `RecyclingProposer`
    recycling_options: dict[str, Any] = field(default_factory=dict)
    # options of the response history's `SuffixProposer`
    history_options: dict[str, Any] = field(default_factory=dict)
    # further options of the `RetrievalProposer` (datastore and context lookups)
    retrieval_options: dict[str, Any] = field(default_factory=dict)


class RasdProposer(ProposerBase):
    """Retrieval tree, pruned by a probability source, fused into the draft model's tree."""

    name = "rasd"

    def __init__(self, datastores: Sequence[SuffixArray] | None = None, draft_model: torch.nn.Module | None = None,
                 recycling: RecyclingMatrix | None = None, history: ResponseHistory | None = None,
                 draft_proposer: Any = None, gate: DraftGate | None = None, config: RasdConfig | None = None,
                 **fields: Any):
        """What it drafts from (index datastores, a draft model or an already-built draft, the recycling
        matrix, the response history) and the draft gate; `config`, or its `fields` by name, sets the knobs."""
        if config is not None and fields:
            raise ValueError("pass either config or RasdConfig fields, not both")
        self.config = config = config if config is not None else RasdConfig(**fields)
        self.draft = self._make_draft(draft_model, draft_proposer, config.draft_options)
        retrieval_options = dict(config.retrieval_options)
        if config.context_min_ngram is not None:
            retrieval_options["context_min_ngram"] = config.context_min_ngram
        elif self.draft is not None:
            retrieval_options.setdefault("context_min_ngram", CONTEXT_MIN_NGRAM_WITH_DRAFT)
        self.retrieval = RetrievalProposer(datastores, **retrieval_options)
        self.short_copies = self._make_short_copies(config.short_copies)
        self.history = history   # the engine adds each finished response here (`GenerationStream.finish`)
        history_options = dict(config.history_options)
        if self.draft is not None:
            history_options.setdefault("min_match", HISTORY_MIN_MATCH_WITH_DRAFT)
        self.from_history = None if history is None else SuffixProposer(history, use_context=False, **history_options)
        self.recycling = None if recycling is None else RecyclingProposer(recycling, **config.recycling_options)
        self.flat_curve = config.flat_curve
        # the engine installs its fast kernels on `proposer.model` (a local draft's module, a head's too)
        self.model = self.draft.model if self.draft is not None else None
        self.prune_config = config.prune_config
        self.probs_fn = config.probs_fn if config.probs_fn is not None else self._probability_source(config.prune_with)
        self._probs_from_draft = (config.probs_fn is None and config.prune_with in ("auto", "draft")
                                  and self.draft is not None)
        # Whether to run the draft model this step, per retrieval match class: where the request's own text
        # already has the continuation, or the draft is rarely right, its forwards cost more than the tokens
        # they add (measured; `rasd.decoding.sizing.gate`). The engine gives one with cost sizing.
        self.gate = gate if self.draft is not None else None
        self._sizer: Any = None   # the engine's sizer (`use_sizer`)

    @staticmethod
    def _make_draft(draft_model: torch.nn.Module | None, draft_proposer: Any,
                    draft_options: dict[str, Any] | None) -> Any:
        """A local `DraftModelProposer` over `draft_model`, or an already-built one (`draft_proposer`).

        Why both: a draft served elsewhere (`rasd.distributed.draft_worker.RemoteDraft`, a `ProposerBase` with
        the drafter's hooks `root_probs`, `gate_open`, `finish`) is built by the caller, with its options where
        the model lives.
        """
        if draft_proposer is None:
            return None if draft_model is None else DraftModelProposer(draft_model, **(draft_options or {}))
        if draft_model is not None or draft_options:
            raise ValueError("pass either draft_model (with draft_options) or draft_proposer, not both")
        return draft_proposer

    def _make_short_copies(self, wanted: bool) -> ShortCopies | None:
        """One-token copies scored per request (`ShortCopies`), where the context source leaves them out."""
        context = self.retrieval.context
        if not wanted or context is None or context.min_ngram <= 1:
            return None
        return ShortCopies(source=context.source, max_matches=context.max_matches, max_len=context.max_len)

    def _probability_source(self, prune_with: str) -> ProbsFn | None:
        """"auto": the draft model, else nothing (counts); "draft", "recycling" or "counts" explicitly.

        Recycled probabilities are not the default: they are the target's top-k after the root token in
        some EARLIER context. On 6 LongBench QA rows (bench/measure_retrieval.py, 96 tokens) pruning with
        them raised mean accepted tokens only from 2.75 to 2.88 while trees grew from 19 to 25 nodes
        (pruned retrieval room is refilled with recycled nodes); not worth the verification cost on a CPU.
        """
        choices = {"auto": self.draft.root_probs if self.draft else None,
                   "draft": self.draft.root_probs if self.draft else None,
                   "recycling": self.recycling.root_probs if self.recycling else None, "counts": None}
        if prune_with not in choices:
            raise ValueError(f"unknown prune_with {prune_with!r}; choose one of {', '.join(choices)}")
        if prune_with in ("draft", "recycling") and choices[prune_with] is None:
            raise ValueError(f"prune_with={prune_with!r} needs a {prune_with} source")
        return choices[prune_with]

    @property
    def wants_hidden(self) -> bool:
        """Whether the draft reads the target's features (an EAGLE head): the engine then hands them over."""
        return self.draft is not None and self.draft.wants_hidden

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers the draft's head reads beside the final features (EAGLE-3)."""
        return () if self.draft is None else tuple(self.draft.feature_layers)

    def observe_hidden(self, start: int, hidden: torch.Tensor) -> None:
        """The target's features of positions start.. (`decoding.features`), for the draft."""
        self.draft.observe_hidden(start, hidden)

    def use_sizer(self, sizer: Any) -> None:
        """The draft stops growing where the sizer says another layer cannot pay (`DraftModelProposer`); the
        sizer's one-node arm, when it has one, decides the steps where nothing was copied (`_gate_lets_draft`)."""
        self._sizer = sizer
        if self.draft is not None:
            self.draft.use_sizer(sizer)

    def finish(self) -> None:
        """The request ended: its draft frees what it holds (a draft worker's state for this request)."""
        if self.draft is not None:
            self.draft.finish()

    def scope(self, doc_tokens: Sequence[Sequence[int]] | None) -> None:
        """This request's retrieved documents (see `RetrievalProposer.scope`)."""
        self.retrieval.scope(doc_tokens)

    def set_datastores(self, datastores: Sequence[SuffixArray] | None) -> None:
        """Replace the whole-index datastores."""
        self.retrieval.set_datastores(datastores)

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        self.retrieval.start(prompt_ids, sampling)
        if self.short_copies is not None:
            self.short_copies.reset()
        if self.draft is not None:
            self.draft.start(prompt_ids, sampling)
        if self.gate is not None:
            self.gate.reset()

    def propose(self, context: list[int], max_nodes: int) -> DraftTree:
        if max_nodes <= 0:
            return DraftTree.root_only(context[-1])
        trees = self.retrieval.candidate_trees(context, max_nodes)
        trees += self._short_copy_trees(context, trees, max_nodes)
        own = [t for t in trees if t.sources[1] == CONTEXT]
        retrieved = merge_trees(context[-1], [t for t in trees if t.sources[1] != CONTEXT], max_nodes)
        earlier = self._history_trees(context, max_nodes)
        trees = trees + earlier   # a history match counts as a match (gate, recycling fallback, bucket)
        use_draft = self.draft is not None and self._gate_lets_draft(len(context), self._gate_bucket(trees))
        if use_draft:   # can its first forward pay, beside the rest? (a draft worker's always may)
            use_draft = self.draft.gate_open(context, self._free_nodes(context, trees, max_nodes))
        probs = (self.probs_fn(context) if self.probs_fn is not None and retrieved.num_draft_tokens
                 and (use_draft or not self._probs_from_draft) else None)
        kept, pruned = prune(retrieved, probs, self.prune_config)
        # room for the copying sources (the request's own text, then the index) before the draft fills the budget
        reserved = sum(t.num_draft_tokens for t in (*own, *earlier)) + kept.num_draft_tokens
        tree = self._draft_tree(context, max_nodes, reserved, use_draft)
        drafted = set(tree.sources[1:])   # what a retrieval source proposes too is credited to it (`fuse`)
        # The request's own text (prompt + output) goes in before the datastore: in document QA the cited
        # chunks are in the prompt and small models repeat their own phrasing, so it is the best-accepted
        # source (measured on LongBench QA rows); retrieval branches, pruned, fill the remaining budget.
        # Recycled guesses come last: they exist at every step, but are less often right than a long match.
        recycled = ([self.recycling.propose(context, max_nodes)]
                    if self._recycle(context, trees, tree.num_draft_tokens > 0) else [])
        # the longer of the two copying matches first (the request's own text on a tie), as retrieval orders its
        # sources: a long history match is an earlier answer being repeated, a 1-token one is noise
        copying = sorted((*own, *earlier), key=lambda t: -t.bucket)
        for part in (*copying, kept, *recycled):
            tree = fuse(tree, part, max_nodes, drafted)
        tree.bucket = match_class(max((t.bucket for t in trees), default=0))
        tree.pruned = pruned
        return tree

    def _gate_lets_draft(self, context_len: int, bucket: int) -> bool:
        """The draft gate's arm for this step (True without a gate)."""
        if self.gate is None:
            return True
        return self.gate.choose(context_len, bucket, step=getattr(self._sizer, "steps", None))

    def _free_nodes(self, context: list[int], trees: list[DraftTree], max_nodes: int) -> DraftTree:
        """The candidates this step has without the draft (the copying sources, retrieval unpruned), one tree."""
        free = merge_trees(context[-1], sorted(trees, key=lambda t: -t.bucket), max_nodes)
        free.bucket = match_class(max((t.bucket for t in trees), default=0))
        return free

    def _short_copy_trees(self, context: list[int], trees: list[DraftTree], max_nodes: int) -> list[DraftTree]:
        """The one-token copies, as a list: only where the request's own text has no longer match and they
        have been paying in this request (`ShortCopies`)."""
        if self.short_copies is None or any(t.sources[1] == CONTEXT for t in trees):
            return []
        tree = self.short_copies.tree(self.retrieval.context.index, context, max_nodes)
        return [] if tree is None else [tree]

    def _history_trees(self, context: list[int], max_nodes: int) -> list[DraftTree]:
        """The response history's tree, as a list: empty without a history or a match."""
        if self.from_history is None:
            return []
        tree = self.from_history.candidate_tree(context, max_nodes)
        return [tree] if tree.num_draft_tokens else []

    def _gate_bucket(self, trees: list[DraftTree]) -> int:
        """The gate's context: retrieval found nothing / a short match (< 4 tokens) / a long one."""
        longest = max((t.bucket for t in trees if t.num_draft_tokens), default=0)
        return 0 if longest == 0 else 1 if longest < 4 else 2

    def _recycle(self, context: list[int], trees: list[DraftTree], drafted: bool) -> bool:
        """Whether to add the recycled tree: where no other source has a guess (no match, and no draft tree this
        step), and, given `flat_curve` (cost sizing), at every step where the cost curve is flat.

        Measured on LongBench QA rows on the CPU: added at every step, recycled nodes filled the budget beside
        the context's continuation and were rarely right there (44 of 1181 accepted), making trees 1.8x larger
        at a steep cost per node. Beside the EAGLE head's tree they were right 14% of the time against the
        head's 26%, and took its room (docs/lab-notes/eagle.md, 2026-12-06, fifth session). On an H200 the
        curve is flat (64 tokens cost 3% more than 1) and recycling alone was the best source on Spec-Bench
        (docs/lab-notes/gpu.md): extra nodes are nearly free there.
        """
        if self.recycling is None:
            return False
        if not (drafted or any(t.num_draft_tokens for t in trees)):
            return True
        return self.flat_curve is not None and self.flat_curve(len(context))

    def observe(self, context: list[int], tree: DraftTree, verdict: Verdict, logits: torch.Tensor) -> None:
        """Recycle the target's top-k at every node; retrieval and draft catch up lazily in `propose`."""
        if self.recycling is not None:
            self.recycling.observe(context, tree, verdict, logits)
        if self.short_copies is not None:
            self._score_rival(tree, verdict)

    def _score_rival(self, tree: DraftTree, verdict: Verdict) -> None:
        """What the drafter's own nodes got accepted at a step it ran with nothing copied: the bar that one-token
        copies must clear to take such steps (`ShortCopies.pays`)."""
        if CONTEXT not in tree.sources and not FREE_SOURCES.issuperset(tree.sources):
            self.short_copies.observe_rival(sum(tree.sources[i] not in FREE_SOURCES for i in verdict.accepted))

    def _draft_tree(self, context: list[int], max_nodes: int, retrieved_nodes: int, use_draft: bool) -> DraftTree:
        """The draft model's tree (root only when it is off this step), leaving up to half the budget to the
        copying sources (`retrieved_nodes`: their candidates). Why: with the draft tree as the base and the
        budget its own, the context's matches (the best source in document QA) were fused into a full tree and
        dropped; `rasd` with the EAGLE head then offered a tenth of the context matches `pld` did."""
        if not use_draft:
            return DraftTree.root_only(context[-1])
        budget = max(max_nodes - min(retrieved_nodes, max_nodes // 2), 1)
        return self.draft.propose(context, budget)
