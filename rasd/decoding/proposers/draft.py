"""`draft`: a small causal LM that shares the target's tokenizer proposes a chain or a top-k tree.

The draft model keeps its own KV cache in step with the committed context: before drafting, the cache is
cut back to the longest prefix it shares with the context, and the missing committed tokens are fed in one
forward. Tree drafting expands layer by layer: one draft forward over the frontier (tree attention mask),
each frontier node's top-k children, the global top `width` by path probability p̂ kept as the next
frontier; deepening stops at `max_depth` or when the best frontier p̂ falls under `min_prob`. With
`min_prob=None` that floor is δ, the measured draft-forward / target-step time ratio (as for OPT-Tree): one
more draft forward is worth its time only while the node it adds is at least that likely to be accepted.
With sampling (temperature > 0) the draft is a chain sampled from the draft's warped distribution q, and q
is attached to each node so the verifier can apply the exact SpecInfer residual rule.

`shape="optree"` (method `optree`) grows the OPT-Tree instead (`rasd.decoding.drafting.optree`): the tree of n nodes
(n = the sizer's budget) with the largest expected acceptance length, deepened while the gain exceeds δ.
Its nodes are deterministic top-n candidates, in greedy and in sampling mode alike (no q attached): the
verifier accepts such a candidate x with probability p(x) and zeroes it on rejection, which is exact.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rasd.decoding.drafting.optree import DEFAULT_MAX_DEPTH, delta_from_times, grow_opt_tree
from rasd.decoding.model import fast_forward
from rasd.decoding.proposers.base import ProposerBase
from rasd.decoding.sizing.gate import DraftGate
from rasd.decoding.step.cache import TreeCache
from rasd.decoding.step.sampling import GREEDY, SamplingParams, target_probs
from rasd.decoding.step.tree import DraftTree
from rasd.decoding.step.verify import Verdict

SOURCE = "draft"
SHAPES = ("topk", "optree")
DEFAULT_WINDOW = 256   # prompt tokens a draft reads (see `DraftModelProposer.__init__`)


@dataclass
class DraftConfig:
    """The knobs of a model drafter's tree (`DraftModelProposer`; `EagleConfig` for the EAGLE head)."""

    max_depth: int | None = None   # the deepest layer; None: OPT-Tree's cap for shape "optree", else 6
    top_k: int = 1                 # children tried per frontier node
    width: int = 1                 # frontier nodes kept per layer, by path probability p̂
    min_prob: float | None = 0.05  # stop deepening below this p̂; None: δ (draft forward / target step)
    seed: int = 0                  # the sampling chain's generator
    shape: str = "topk"            # "topk" (chain / EAGLE-2 tree) or "optree" (`drafting.optree`)
    delta: float | None = None     # OPT-Tree's δ when fixed; None: measured (`target_step_s`)
    target_step_s: Callable[[int], float | None] | None = None   # context length -> a plain target step (s)
    node_cap: Callable[[int], int] | None = None   # context length -> OPT-Tree's node cap (the cost curve's)
    window: int | None = DEFAULT_WINDOW   # prompt tokens the draft reads (None: all)


class DraftModelProposer(ProposerBase):
    """Chain (width=1, top_k=1), top-k tree or OPT-Tree (shape="optree") drafts from a separate small model."""

    name = "draft"
    config_class: type[DraftConfig] = DraftConfig   # the defaults of this drafter's knobs

    def __init__(self, model: torch.nn.Module, gate: DraftGate | None = None, config: DraftConfig | None = None,
                 **fields: Any):
        """`model` drafts; `gate` decides per step whether to draft at all (`sizing.gate`, the engine gives one
        with cost sizing); `config`, or its fields by name, sets the tree's knobs."""
        if config is not None and fields:
            raise ValueError("pass either config or DraftConfig fields, not both")
        self.config = config = config if config is not None else self.config_class(**fields)
        max_depth, top_k, width, min_prob = config.max_depth, config.top_k, config.width, config.min_prob
        seed, shape, delta, target_step_s = config.seed, config.shape, config.delta, config.target_step_s
        node_cap, window = config.node_cap, config.window
        if shape not in SHAPES:
            raise ValueError(f"unknown draft shape {shape!r}; choose one of {', '.join(SHAPES)}")
        self.model = model
        self.source = SOURCE    # the tag of its nodes in statistics (a subclass drafting otherwise has its own)
        self.shape = shape
        if shape == "optree":
            self.name = "optree"
        if max_depth is None:
            max_depth = DEFAULT_MAX_DEPTH if shape == "optree" else 6
        self.max_depth, self.top_k, self.width, self.min_prob = max_depth, top_k, width, min_prob
        # OPT-Tree's δ: fixed when given, else the measured draft-forward / target-step time ratio.
        # `target_step_s(context_len)` gives the target's plain-step latency (from the engine's cost curve).
        self.delta, self.target_step_s = delta, target_step_s
        # OPT-Tree's n: at most node_cap(context_len) nodes (engine: the tree size the cost curve verifies for
        # about the price of one token). Growing 64-node layers that the sizer then cuts to 3 wastes drafts.
        self.node_cap = node_cap
        # Whether to draft at all this step (engine: with cost sizing): drafts are paid for before the sizer
        # can drop them (see `rasd.decoding.sizing.gate`).
        self.gate = gate
        self.forward_s: float | None = None   # EMA of one frontier draft forward (seconds)
        # EMA of what a step's first draft forward really costs when the draft is caught up: the whole `propose`
        # less its later layers' forwards (the catch-up, the root's logits, top-k, building the tree). Why apart
        # from `forward_s`: a head's try costs more than one timed forward, and judged by `forward_s` alone
        # `root_pays` let it try where it cannot pay (docs/lab-notes/decoding-speed.md, "draft root cost").
        self.root_s: float | None = None
        self._try: tuple[float, float] | None = None   # (start, seconds of later layers) of the propose running
        self._caught_up = 0                            # tokens the last `_sync` ran
        # With cost sizing (`use_sizer`): whether one more draft layer can pay for its forward
        # (`CostAwareSizer.grow_pays`); None: grow while candidates clear the probability floor.
        self.grow_pays: Callable[[DraftTree, list[int], int, float], bool] | None = None
        # ... and whether this step's first draft forward can (`CostAwareSizer.root_pays`): (root token,
        # source, context length, forward seconds, free nodes beside) -> bool; None: always draft (gate aside).
        self.root_pays: Callable[[int, str, int, float, DraftTree | None], bool] | None = None
        self._decision: tuple[int, bool] | None = None   # (context length, draft or not) of this step
        self.last_layers = 0                   # OPT-Tree layers grown by the last propose (statistics, tests)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache = self._new_cache()
        self.cached: list[int] = []     # tokens whose keys/values are in self.cache: context[offset:]
        # The draft reads at most the last `window` tokens of a request's prompt (then everything after it).
        # Why: its first forward of a request, or the first after the gate kept it idle, must run over every
        # token it has not seen; over a 1k-token document-QA prompt that is a prefill of the draft's layers
        # (≈ 0.2 s for the EESD self-draft on a CPU, several target steps) for one draft. Drafts are verified,
        # so a shorter draft context can only cost acceptance, never change the output.
        self.window, self.offset = window, 0
        self.sampling = GREEDY
        self.gen = torch.Generator().manual_seed(seed)
        self.root_logits: torch.Tensor | None = None   # [vocab] draft logits at the root of self.cached

    def _new_cache(self) -> Any:
        """An empty cache for the draft's layers (a subclass with another model brings its own)."""
        return TreeCache.for_model(self.model)

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        self.cache = self._new_cache()
        self.cached, self.offset = [], 0
        self.root_logits = None
        self.sampling = sampling
        if sampling.seed is not None:
            self.gen.manual_seed(sampling.seed + 1)
        if self.gate is not None:
            self.gate.reset()
        self._decision = None

    def gate_open(self, context: list[int], beside: DraftTree | None = None) -> bool:
        """Whether to run the drafter this step: the gate's arm (when there is one), then whether its first
        forward can pay (`root_pays`, with a cost sizer; `beside`: the step's nodes from free sources, which its
        own would stand beside). Decided once per step: a caller that asks before `propose` (`rasd`, to know
        whether to prune with this draft) gets the same answer, counted once."""
        if self._decision is not None and self._decision[0] == len(context):
            return self._decision[1]
        answer = (self.gate is None or self.gate.choose(len(context))) and self._root_pays(context, beside)
        self._decision = (len(context), answer)
        return answer

    def _root_pays(self, context: list[int], beside: DraftTree | None = None) -> bool:
        """The sizer's verdict on this step's first draft forward (yes before a forward was timed)."""
        if self.root_pays is None or self.forward_s is None:
            return True
        first = self.root_s if self.root_s is not None else self.forward_s
        return self.root_pays(context[-1], self.source, len(context), first, beside)

    def _begin_try(self) -> None:
        """A drafting `propose` starts (the gate let it through): its time is `root_s`' sample at `_end_try`."""
        self._try = (time.perf_counter(), 0.0)

    def _end_try(self) -> None:
        """Fold this propose's time, less its later layers, into `root_s` (only when the catch-up was short:
        after an idle stretch it runs over every token since, a cost of the idling, not of a draft step)."""
        if self._try is None:
            return
        start, later = self._try
        self._try = None
        if self._caught_up <= 4:
            elapsed = time.perf_counter() - start - later
            self.root_s = elapsed if self.root_s is None else 0.8 * self.root_s + 0.2 * elapsed

    @torch.inference_mode()
    def propose(self, context: list[int], max_nodes: int) -> DraftTree:
        tree = DraftTree.root_only(context[-1])
        if max_nodes <= 0 or not self.gate_open(context):
            return tree
        self._begin_try()
        logits = self._sync(context)   # [vocab] at the root; None: nothing to draft from yet
        if logits is None:
            self._try = None
            return tree
        if self.shape == "optree":
            cap = self.node_cap(len(context)) if self.node_cap is not None else max_nodes
            tree = self._opt_tree(context, logits, max(1, min(max_nodes, cap)))
        elif self.sampling.greedy:
            self._expand_tree(tree, logits, len(context), max_nodes)
        else:
            self._sample_chain(tree, logits, len(context), max_nodes)
        self.cache.crop(-(self.cache.get_seq_length() - len(self.cached)))
        self._end_try()
        return tree

    def observe(self, context: list[int], tree: DraftTree, verdict: Verdict, logits: torch.Tensor) -> None:
        """The cache catches up in the next `propose`."""

    @torch.inference_mode()
    def root_probs(self, context: list[int]) -> torch.Tensor | None:
        """Draft next-token probabilities [vocab] after `context` (temperature 1, unwarped); None when the
        drafter has nothing to draft from yet (an EAGLE head before the target's first features).

        RASD prunes retrieved branches with them; right after `propose(context)` they come from that
        draft forward for free.
        """
        logits = self.root_logits
        if logits is None or not self._holds(context):
            logits = self._sync(context)   # leaves the cache holding exactly `context`
        return None if logits is None else logits.softmax(-1)

    def _sync(self, context: list[int]) -> torch.Tensor | None:
        """Make the cache hold context[:-1] + root and return the draft logits at the root [vocab]."""
        if self.root_logits is not None and self._holds(context):
            return self.root_logits      # already synced (root_probs ran first): no forward needed
        if not self.cached and self.window is not None:
            self.offset = max(0, len(context) - self.window)
        seen = context[self.offset:]
        common = 0
        limit = min(len(self.cached), len(seen) - 1)
        while common < limit and self.cached[common] == seen[common]:
            common += 1
        self.cache.crop(-(self.cache.get_seq_length() - common))
        new = seen[common:]
        ids = torch.tensor([new], dtype=torch.long, device=self.device)
        pos = torch.arange(self.offset + common, len(context), device=self.device)[None]   # true positions
        t0 = time.perf_counter()
        logits = fast_forward.forward(self.model, self.cache, ids, pos, last_only=True)   # [1, 1, vocab]
        self.cached = list(seen)
        self.root_logits = logits[0, -1].float()
        self._caught_up = len(new)
        if len(new) <= 4:   # a catch-up of a few tokens costs about one draft step: a sample for δ
            self._time_forward(t0, later=False)
        return self.root_logits

    def _holds(self, context: list[int]) -> bool:
        """Whether the draft cache holds exactly this context (from `offset` on)."""
        return len(self.cached) == len(context) - self.offset and self.cached == context[self.offset:]

    def _time_forward(self, t0: float, later: bool = True) -> None:
        """Fold one draft forward's wall time (since t0) into the EMA behind δ; `later`: a layer after the
        root's (not part of `root_s`)."""
        if self.device.type == "cuda":   # time the forward, not its launch
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - t0
        self.forward_s = elapsed if self.forward_s is None else 0.8 * self.forward_s + 0.2 * elapsed
        if later and self._try is not None:
            self._try = (self._try[0], self._try[1] + elapsed)

    def _node_inputs(self, tree: DraftTree, first: int, context_len: int
                     ) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tree nodes first.., their ids [1, n], positions [1, n] and additive mask [1, 1, n, past + n]: each
        node sees the cached context and its own ancestors (earlier non-root nodes are already cached)."""
        nodes = list(range(first, len(tree)))
        past = self.cache.get_seq_length()              # context + tree nodes 1..first-1
        anc = tree.ancestor_mask()[first:, 1:]          # [n, len(tree) - 1], root is part of the context
        visible = torch.ones(len(nodes), past + len(nodes), dtype=torch.bool)
        visible[:, context_len - self.offset:] = anc
        mask = torch.zeros(visible.shape, dtype=self.dtype).masked_fill_(~visible, torch.finfo(self.dtype).min)
        depths = tree.depths()
        ids = torch.tensor([[tree.tokens[i] for i in nodes]], device=self.device)
        pos = torch.tensor([[context_len - 1 + depths[i] for i in nodes]], device=self.device)
        return nodes, ids, pos, mask[None, None].to(self.device)

    def _forward_nodes(self, tree: DraftTree, first: int, context_len: int) -> torch.Tensor:
        """Draft logits [n, vocab] for tree nodes first.."""
        _, ids, pos, mask = self._node_inputs(tree, first, context_len)
        t0 = time.perf_counter()
        logits = fast_forward.forward(self.model, self.cache, ids, pos, mask, exact=False)[0].float()
        self._time_forward(t0)
        return logits

    def current_delta(self, context_len: int) -> float:
        """OPT-Tree's δ: the configured one, else t_draft / t_target when both are known, else 0.5."""
        if self.delta is not None:
            return self.delta
        target_s = self.target_step_s(context_len) if self.target_step_s is not None else None
        return delta_from_times(self.forward_s, target_s)

    def _opt_tree(self, context: list[int], root_logits: torch.Tensor, max_nodes: int) -> DraftTree:
        """OPT-Tree of `max_nodes` nodes; each layer is one batched draft forward over the frontier."""
        context_len = len(context)

        def expand(grown: DraftTree, frontier: list[int]) -> torch.Tensor:   # -> [F, vocab]
            logits = root_logits[None] if frontier == [0] else self._forward_nodes(grown, frontier[0], context_len)
            return self._node_probs(logits)

        result = grow_opt_tree(context[-1], expand, max_nodes, self.current_delta(context_len),
                               self.max_depth, self.source)
        self.last_layers = result.layers
        return result.tree

    def _node_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft probabilities behind p̂: plain softmax when greedy, the warped q when sampling.

        Under sampling a deterministic candidate x is accepted with the target's warped p(x), which the
        draft's warped distribution estimates better than its raw one.
        """
        return logits.softmax(-1) if self.sampling.greedy else target_probs(logits, self.sampling)

    def _expand_tree(self, tree: DraftTree, root_logits: torch.Tensor, context_len: int, max_nodes: int) -> None:
        """Greedy drafting: top-k children per frontier node, keep the global top `width` by p̂."""
        frontier, frontier_logits = [0], root_logits[None]
        floor = self.current_delta(context_len) if self.min_prob is None else self.min_prob
        for depth in range(self.max_depth):
            probs = frontier_logits.softmax(-1)                       # [F, vocab]
            top_p, top_t = probs.topk(self.top_k, dim=-1)             # [F, k]
            cands = [(tree.scores[f] * float(top_p[j, c]), f, int(top_t[j, c]))
                     for j, f in enumerate(frontier) for c in range(self.top_k)]
            cands.sort(key=lambda c: -c[0])
            cands = [c for c in cands[: self.width] if c[0] >= floor]
            room = max_nodes - tree.num_draft_tokens
            if not cands or room <= 0:
                return
            first = len(tree)
            for score, parent, tok in cands[:room]:
                tree.add(parent, tok, self.source, score)
            frontier = list(range(first, len(tree)))
            if depth + 1 >= self.max_depth or tree.num_draft_tokens >= max_nodes or not frontier:
                return   # (the old frontier's logits must never meet the new frontier)
            if not self._grow(tree, frontier, context_len):
                return
            frontier_logits = self._forward_nodes(tree, first, context_len)

    def _grow(self, tree: DraftTree, frontier: list[int], context_len: int) -> bool:
        """Whether to run the next draft layer: always without a sizer's verdict or before a forward was timed."""
        if self.grow_pays is None or self.forward_s is None:
            return True
        return self.grow_pays(tree, frontier, context_len, self.forward_s)

    def use_sizer(self, sizer: Any) -> None:
        """Let a cost-aware sizer stop the tree's growth where another layer cannot pay (`grow_pays`), and skip
        the draft where even its first forward cannot (`root_pays`)."""
        self.grow_pays = getattr(sizer, "grow_pays", None)
        self.root_pays = getattr(sizer, "root_pays", None)

    def _sample_chain(self, tree: DraftTree, root_logits: torch.Tensor, context_len: int, max_nodes: int) -> None:
        """Sampling: a chain drawn from q, with q kept on every node for exact verification.

        The chain may stop early (`_grow`): whether to draw the next node depends only on the nodes drawn so
        far, never on the target, so given its prefix every drawn node is still distributed as q and the
        verification stays exact (what is never done: dropping a drawn node because of its value).
        """
        logits, node, score = root_logits, 0, 1.0
        length = min(self.max_depth, max_nodes)
        for step in range(length):
            q = target_probs(logits, self.sampling)                   # [vocab]
            tok = int(torch.multinomial(q, 1, generator=self.gen).item())
            score *= float(q[tok])
            node = tree.add(node, tok, self.source, score)
            tree.q[node] = q
            if step + 1 >= length or not self._grow(tree, [node], context_len):
                return
            logits = self._forward_nodes(tree, node, context_len)[0]
