"""`eesd` and `adaeagle`: chain drafts whose length a policy decides before and during drafting.

EESD (arXiv 2406.03853) drafts with the target's own first N layers, one trained exit decoder layer (same
architecture as a target layer, initialised from layer N, trained by `rasd train eesd`) and the target's
final norm and LM head, restricted to the tokens the target most often writes when training chose a draft
vocabulary (`SubsetHead`). `early_exit_model` builds that draft as an ordinary HF causal LM whose modules ARE
the target's (no weight copies, except the final norm: a 1-vector copy, so that a hook on the target's norm
(AdaEAGLE's tap) does not fire on draft forwards). It keeps its own small KV cache of N + 1 layers, driven
exactly like a separate draft model (`DraftModelProposer`): sharing the target's cache for the first N
layers would save the draft's catch-up forward over newly committed tokens (one short forward per step), but
the target's cache also holds tree entries until compaction; correctness first.

Draft length: `eesd` samples it by Thompson sampling (`sizing.sizers.ThompsonSizer.sample_depth`: a Beta(α, β)
posterior on per-token acceptance, sampled level by level, hard cap; α/β updated from each verdict).
`adaeagle` predicts k with the LDLP and stops by AdaEAGLE-DDD (`rasd.decoding.sizing.ldlp`), over the target's
EAGLE head by default (`HeadLengthProposer`), else a draft model or the EESD self-draft. Greedy: a chain of
argmax tokens (`eesd` also hangs each chain token's two runner-ups on as leaves: free from the same
logits, and often right where the argmax is not). Sampling: a chain drawn from the draft's warped q with q
attached to every node, so the verifier applies the exact residual rule; the stop rule only looks at tokens
already drawn.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from rasd import paths
from rasd.decoding.proposers.draft import DraftModelProposer
from rasd.decoding.proposers.eagle import EagleProposer
from rasd.decoding.sizing.gate import DraftGate
from rasd.decoding.sizing.sizers import ThompsonSizer
from rasd.decoding.step.sampling import SamplingParams, target_probs
from rasd.decoding.step.tree import DraftTree
from rasd.decoding.step.verify import Verdict

FORMAT = "rasd-eesd-1"


class LengthPolicy(Protocol):
    """How long a chain to draft: `limit` before drafting, `stop` after each token, `observe` the verdict."""

    def start(self) -> None: ...

    def limit(self, context: list[int]) -> int: ...

    def stop(self, step: int, cum_logprob: float) -> bool: ...

    def observe(self, tree: DraftTree, accepted: list[int]) -> None: ...


class ThompsonLength:
    """EESD's Thompson-sampled draft length: the same `ThompsonSizer`, used before drafting."""

    def __init__(self, sizer: ThompsonSizer | None = None):
        self.sizer = sizer or ThompsonSizer(min_depth=1, max_depth=10)

    def start(self) -> None:
        """The posterior carries over between requests (same model, same text kind)."""

    def limit(self, context: list[int]) -> int:
        return self.sizer.sample_depth()

    def stop(self, step: int, cum_logprob: float) -> bool:
        return False

    def observe(self, tree: DraftTree, accepted: list[int]) -> None:
        self.sizer.observe(tree, accepted, 0.0)


def default_layers(num_layers: int) -> int:
    """EESD's N: a seventh of the target's layers (4 of SmolLM2-135M's 30), at least 1.

    Measured on SmolLM2-135M (1,600 ShareGPT prompts, 800 steps): held-out top-1 agreement 0.34 / 0.36 /
    0.35 / 0.38 for N = 4 / 6 / 8 / 10. It barely grows with N (the exit layer, trained on ~70k positions,
    is the limit), while each draft token costs N + 1 layers: the fewest layers win.
    """
    return max(1, num_layers // 7)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.get_decoder().layers


def new_exit_layer(target: nn.Module, layers: int) -> nn.Module:
    """A trainable copy of target layer `layers` (its cache slot is `layers` in the N + 1-layer draft)."""
    layer = copy.deepcopy(decoder_layers(target)[layers])
    layer.self_attn.layer_idx = layers
    return layer


class SubsetHead(nn.Module):
    """The target's LM head restricted to a draft vocabulary: full-vocabulary logits, -inf outside it.

    Why: on a CPU the full-vocabulary head is a large share of a draft step, and the draft only needs to be
    right about the tokens the target actually writes (FR-Spec's frequency-ranked subset; measured:
    docs/lab-notes/decoding-speed.md, "draft vocabulary"). Tokens outside the subset are never drafted;
    verification is unchanged, so output is too.
    Under sampling q is 0 outside the subset, which the residual rule handles exactly.
    """

    def __init__(self, full: nn.Module, ids: torch.Tensor):
        super().__init__()
        weight = full.weight.detach()
        self.vocab = weight.shape[0]
        self.register_buffer("ids", ids.to(weight.device, torch.long), persistent=False)
        self.register_buffer("weight", weight.index_select(0, self.ids).clone(), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:   # [..., H] -> [..., vocab]
        part = torch.nn.functional.linear(hidden, self.weight)   # [..., V_draft]
        out = part.new_full((*part.shape[:-1], self.vocab), float("-inf"))
        return out.index_copy_(-1, self.ids, part)


def early_exit_model(target: nn.Module, exit_layer: nn.Module, layers: int,
                     vocab: torch.Tensor | None = None) -> nn.Module:
    """An HF causal LM = target layers [:N] + `exit_layer` + a copy of the final norm + the target's LM head.

    With `vocab` (token ids) the head is the target's restricted to them (`SubsetHead`).
    """
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers + 1
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types[: layers + 1])
    with torch.device("meta"):
        draft = type(target)(config)
    base, inner = target.get_decoder(), draft.get_decoder()
    inner.embed_tokens = base.embed_tokens
    inner.layers = nn.ModuleList([*base.layers[:layers], exit_layer])
    inner.norm = copy.deepcopy(base.norm)
    inner.rotary_emb = base.rotary_emb
    draft.lm_head = target.lm_head if vocab is None else SubsetHead(target.lm_head, vocab)
    draft.generation_config = target.generation_config
    leftovers = [n for n, p in [*draft.named_parameters(), *draft.named_buffers()] if p.is_meta]
    if leftovers:
        raise ValueError(f"early-exit draft of {type(target).__name__}: unshared modules {leftovers[:3]}")
    return draft.eval()


def eesd_path(model_name: str) -> Path:
    """Default exit-layer weights: $RASD_HOME/eesd/<model>.safetensors."""
    return paths.eesd_path(model_name)


VOCAB_KEY = "draft_vocab"   # optional int64 tensor of draft-vocabulary token ids beside the layer's weights


def save_exit_layer(path: Path, layer: nn.Module, layers: int, extra: dict[str, Any] | None = None,
                    vocab: torch.Tensor | None = None) -> None:
    """Safetensors of the exit layer's weights (+ the draft vocabulary), N and config in the metadata.

    Written to a temporary name and renamed, so a crash leaves the previous file intact.
    """
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    meta = {"format": FORMAT, "layers": layers, **(extra or {})}
    tensors = {k: v.detach().contiguous().cpu() for k, v in layer.state_dict().items()}
    if vocab is not None:
        tensors[VOCAB_KEY] = vocab.detach().to(torch.long).contiguous().cpu()
    save_file(tensors, str(tmp), metadata={"rasd": json.dumps(meta)})
    tmp.replace(path)


def load_early_exit(target: nn.Module, path: Path | str | None, model_name: str = "default") -> nn.Module:
    """The EESD draft for `target` from trained exit weights; a one-line error saying how to train them."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    file = Path(path) if path else eesd_path(model_name)
    if not file.exists():
        raise ValueError(f"no trained EESD exit layer at {file}: run `rasd train eesd --model {model_name} "
                         f"--data builtin` (or pass --eesd PATH)")
    with safe_open(str(file), framework="pt") as fh:
        meta = json.loads((fh.metadata() or {}).get("rasd", "{}"))
    if meta.get("format") != FORMAT:
        raise ValueError(f"{file} is not an exit layer written by `rasd train eesd`")
    layers = int(meta["layers"])
    if not 0 < layers < len(decoder_layers(target)):
        raise ValueError(f"{file} was trained for N={layers} layers; the target has {len(decoder_layers(target))}")
    exit_layer = new_exit_layer(target, layers)
    param = next(target.parameters())
    state = load_file(str(file))
    vocab = state.pop(VOCAB_KEY, None)
    exit_layer.load_state_dict({k: v.to(param.device, param.dtype) for k, v in state.items()})
    if vocab is not None and (vocab.numel() == 0 or int(vocab.max()) >= target.get_output_embeddings().weight.shape[0]):
        raise ValueError(f"{file}: its draft vocabulary does not fit this model's vocabulary")
    return early_exit_model(target, exit_layer, layers, vocab)


class LengthControlledProposer(DraftModelProposer):
    """A chain drafted by any draft LM, its length decided by a `LengthPolicy` (eesd, adaeagle)."""

    def __init__(self, model: nn.Module, length: LengthPolicy, name: str, seed: int = 0, siblings: int = 0,
                 gate: DraftGate | None = None):
        super().__init__(model, max_depth=1, top_k=1, width=1, min_prob=0.0, seed=seed, gate=gate)
        self.length, self.name = length, name
        self.source = name
        # Greedy only: the next `siblings` most likely tokens beside each chain token, as leaves. They come
        # from logits the chain computed anyway (no extra draft forward) and a few more tree tokens cost
        # little to verify; the cost-aware sizer drops the ones whose p̂ does not pay.
        self.siblings = siblings

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        super().start(prompt_ids, sampling)
        self.length.start()

    @torch.inference_mode()
    def propose(self, context: list[int], max_nodes: int) -> DraftTree:
        limit = min(self.length.limit(context), max_nodes)   # before any draft forward (the LDLP reads the tap)
        tree = DraftTree.root_only(context[-1])
        if limit <= 0 or not self.gate_open(context):
            return tree
        self._begin_try()
        logits = self._sync(context)                         # [vocab] at the root
        node, cum = 0, 0.0
        leaves: list[tuple[int, int, float]] = []   # (parent, token, p̂), added after the chain's forwards
        for step in range(limit):
            if step and self.length.stop(step, cum):
                break
            if self.sampling.greedy:
                probs = logits.softmax(-1)
                top_p, top_t = probs.topk(1 + self.siblings)
                tok = int(top_t[0])
                leaves += [(node, int(t), math.exp(cum) * float(p)) for p, t in zip(top_p[1:], top_t[1:], strict=True)]
                q = None
            else:
                q = target_probs(logits, self.sampling)       # [vocab]
                probs = q
                tok = int(torch.multinomial(q, 1, generator=self.gen).item())
            cum += math.log(max(float(probs[tok]), 1e-30))
            node = tree.add(node, tok, self.source, math.exp(cum))
            if q is not None:
                tree.q[node] = q
            if step + 1 < limit:
                logits = self._forward_nodes(tree, node, len(context))[0]
        for parent, tok, score in leaves:   # after the last forward: the draft cache holds chain nodes only
            if score > 0.0:
                tree.add(parent, tok, self.source, score)
        self.cache.crop(-(self.cache.get_seq_length() - len(self.cached)))
        self._end_try()
        return tree

    def observe(self, context: list[int], tree: DraftTree, verdict: Verdict, logits: torch.Tensor) -> None:
        self.length.observe(tree, verdict.accepted)


def make_eesd(target: nn.Module, eesd: str | Path | None = None, model_name: str = "default",
              max_depth: int = 10, seed: int = 0, siblings: int = 2, gate: DraftGate | None = None,
              **_: Any) -> LengthControlledProposer:
    """Method `eesd`: the self-draft with a Thompson-sampled length (hard cap `max_depth`).

    `siblings` (greedy): the chain's runner-up tokens as extra leaves (see `LengthControlledProposer`).
    `gate`: whether to draft at all this step (`rasd.decoding.sizing.gate`; the engine gives one with cost sizing).
    """
    draft = load_early_exit(target, eesd, model_name)
    return LengthControlledProposer(draft, ThompsonLength(ThompsonSizer(max_depth=max_depth, seed=seed)), "eesd",
                                    seed=seed, siblings=siblings, gate=gate)


def make_adaeagle(target: nn.Module, draft_model: nn.Module | None = None, eesd: str | Path | None = None,
                  ldlp: str | Path | None = None, model_name: str = "default", seed: int = 0,
                  gate: DraftGate | None = None, drafter: str | None = None, head: Any = None,
                  eagle: str | Path | None = None, **_: Any) -> LengthControlledProposer:
    """Method `adaeagle`: a chain whose length the LDLP predicts and DDD stops, over its `drafter`:

    `eagle` (default without a draft model): the target's EAGLE head (`head`, else the file `eagle`, else the
    trained or shipped one), the drafter AdaEAGLE is defined on; `draft-model` (default with one): that model;
    `eesd`: the target's EESD self-draft. The LDLP is the one trained for that drafter (`rasd train ldlp`)."""
    from rasd.decoding.sizing.ldlp import load_controller

    drafter = drafter or ("draft-model" if draft_model is not None else "eagle")
    controller = load_controller(target, ldlp, model_name, drafter)
    if drafter == "eagle":
        from rasd.decoding.model.eagle_head import shared_head

        head = head if head is not None else shared_head(target, eagle, model_name)
        return HeadLengthProposer(head, controller, "adaeagle", seed=seed, gate=gate)
    if drafter == "draft-model" and draft_model is not None:
        return LengthControlledProposer(draft_model, controller, "adaeagle", seed=seed, gate=gate)
    draft = load_early_exit(target, eesd, model_name)
    return LengthControlledProposer(draft, controller, "adaeagle", seed=seed, gate=gate)


class HeadLengthProposer(LengthControlledProposer, EagleProposer):
    """A length-controlled chain drafted by the target's EAGLE head (AdaEAGLE as its paper builds it): the chain
    and its stop rule are `LengthControlledProposer`'s, the head's cache and features `EagleProposer`'s."""
