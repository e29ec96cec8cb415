"""The method registry: every decoding method declared once, with what it needs and how it is built.

Why one place: the CLI's checks, the service's 400s, the batch job, `build_decoder`'s cost-sizing options and
`make_proposer` all read the same `MethodSpec`. Adding a method is one proposer file plus one entry in
`METHODS` below; nothing else lists method names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from rasd.decoding.model.loading import is_self_draft
from rasd.decoding.proposers.ar import NoDraftProposer
from rasd.decoding.proposers.base import ProposerBase
from rasd.decoding.proposers.draft import DraftModelProposer
from rasd.decoding.proposers.options import (
    AdaeagleOptions,
    DraftOptions,
    EagleOptions,
    EesdOptions,
    MethodOptions,
    OptreeOptions,
    PldOptions,
    RasdOptions,
    RecyclingOptions,
    RetrievalOptions,
    SuffixOptions,
    parse_variant,
)
from rasd.decoding.proposers.pld import PromptLookupProposer
from rasd.decoding.proposers.rasd import RasdProposer
from rasd.decoding.proposers.recycling import RecyclingProposer
from rasd.decoding.proposers.retrieval import RetrievalProposer
from rasd.decoding.proposers.suffix import SuffixProposer
from rasd.decoding.sizing.ldlp import ldlp_path
from rasd.paths import eesd_path

# How a method uses a draft model (the target's own early-exit layers count as one, the "self-draft"):
NO_DRAFT = "none"            # ignores --draft-model
OPTIONAL_DRAFT = "optional"  # uses one when given, runs without
REQUIRED_DRAFT = "required"  # cannot run without one
SELF_DRAFT = "self"          # always the target's EESD self-draft (trained exit layer)
SELF_BY_DEFAULT = "self-by-default"  # the given draft model, else the self-draft
HEAD = "head"                # the target's trained EAGLE head (shipped for the embedded model)
HEAD_BY_DEFAULT = "head-by-default"  # the given draft model (`eesd`: the self-draft), else the EAGLE head


@dataclass
class ProposerInputs:
    """What `build` gets: the draft model (an nn.Module), the index's token suffix arrays, the target's
    shared recycling matrix, the target itself (self-drafts), the method's options, and the response history
    (earlier answers, `decoding.history`; None or False: none)."""

    draft_model: Any = None
    datastores: list[Any] | None = None
    recycling: Any = None
    target_model: Any = None
    options: dict[str, Any] = field(default_factory=dict)
    history: Any = None


@dataclass
class DecoderSetup:
    """What a method's `configure` hook may adjust before its proposer is built (`build_decoder`)."""

    target: Any                  # LoadedModel
    draft: Any                   # LoadedModel | None
    sizing: str
    options: dict[str, Any]
    curve_for: Callable[[int], Any]   # context length -> the target's measured cost curve


@dataclass(frozen=True)
class MethodSpec:
    """One decoding method: its name, what it needs and how to build its proposer."""

    name: str
    summary: str
    build: Callable[[ProposerInputs], ProposerBase]
    draft: str = NO_DRAFT
    uses_index: bool = False          # drafts from the index's suffix arrays (the service needs --index)
    uses_recycling: bool = False      # reads the target's Token Recycling matrix
    uses_history: bool = False        # drafts from earlier responses (a `ResponseHistory`; `history=False`: off)
    gate_block: int | None = None     # with cost sizing, a DraftGate decides per step whether drafting pays
    needs_ldlp: bool = False          # a trained draft-length predictor (AdaEAGLE)
    speculates: bool = True           # False: plain decoding (a tree of the root alone)
    remote_draft: bool = False        # its model draft may run in a DraftWorker actor (`draft_proposer=`)
    configure: Callable[[DecoderSetup], None] | None = None   # cost-sizing options set by build_decoder
    options: type[MethodOptions] = MethodOptions   # what a variant (`method:key=value`) may set, typed

    def defaults(self) -> dict[str, Any]:
        """Each variant option of this method and its default (`options`)."""
        return {f.name: f.default for f in fields(self.options)}

    def uses_self_draft(self, draft_model: str | None) -> bool:
        """Whether this method, given `--draft-model draft_model`, drafts with the target's exit layer."""
        if self.draft in (NO_DRAFT, HEAD):
            return False
        return (self.draft == SELF_DRAFT or is_self_draft(draft_model)
                or (self.draft == SELF_BY_DEFAULT and not draft_model))

    def uses_head(self, draft_model: str | None) -> bool:
        """Whether this method, given `--draft-model draft_model`, drafts with the target's EAGLE head."""
        return self.draft == HEAD or (self.draft == HEAD_BY_DEFAULT and not draft_model)

    def gates_draft(self, draft_model: str | None) -> bool:
        """Whether, with cost sizing, a `DraftGate` decides per step if this method runs its draft model.

        Not for the EAGLE head: the gate's bandit was built for the EESD self-draft (a quarter of a target step
        a draft token) and kept the head off on Spec-Bench qa and writing, where one head node a step was
        accepted half the time (docs/lab-notes/eagle.md, 2026-11-29). The head costs ≈ 7% of a step; the cost
        sizer judges its first forward (`CostAwareSizer.root_pays`) as it judges every later layer."""
        return self.gate_block is not None and not self.uses_head(draft_model)

    def ldlp_drafter(self, draft_model: str | None) -> str:
        """The tag an LDLP is trained and stored under for this method's drafter."""
        if self.uses_head(draft_model):
            return "eagle"
        return "eesd" if self.uses_self_draft(draft_model) else "draft-model"

    def check(self, model: str, draft_model: str | None = None, has_index: bool | None = None,
              sizing: str = "cost", eesd: str | None = None, ldlp: str | None = None,
              eagle: str | None = None) -> None:
        """Raise ValueError (a message a person can act on) when the method cannot run as asked; called
        before any model loads. `has_index=None`: the caller has no notion of an index (`rasd generate`)."""
        if self.draft == REQUIRED_DRAFT and not draft_model:
            raise ValueError(f"method {self.name!r} needs --draft-model (a small model sharing the target's "
                             f"tokenizer, or `eesd` for the target's own early-exit draft)")
        if self.uses_index and has_index is False:
            raise ValueError(f"method {self.name!r} drafts from an index; start the service with --index")
        if self.uses_head(draft_model):
            from rasd.decoding.model.eagle_head import head_path

            file = Path(eagle) if eagle else head_path(model)
            if not file.exists():
                raise ValueError(f"method {self.name!r} needs an EAGLE head for {model} ({file} is missing): run "
                                 f"`rasd train eagle --model {model} --data builtin` (or pass --eagle PATH)")
        if self.uses_self_draft(draft_model):
            file = Path(eesd) if eesd else eesd_path(model)
            if not file.exists():
                raise ValueError(f"method {self.name!r} needs a trained EESD exit layer ({file} is missing): run "
                                 f"`rasd train eesd --model {model} --data builtin` (or pass --eesd PATH)")
        if self.needs_ldlp or sizing == "ldlp":
            tag = self.ldlp_drafter(draft_model)
            file = Path(ldlp) if ldlp else ldlp_path(model, tag)
            if not file.exists():
                what = f"method {self.name}" if self.needs_ldlp else "sizing ldlp"
                raise ValueError(f"{what} needs a trained LDLP ({file} is missing): run `rasd train ldlp --model "
                                 f"{model} --drafter {'PATH' if tag == 'draft-model' else tag}` (or pass --ldlp PATH)")


# ---------------------------------------------------------------------------------------------- builders


def _needs_draft(name: str, inputs: ProposerInputs) -> Any:
    if inputs.draft_model is None:
        raise ValueError(f"method {name!r} needs a draft model (--draft-model) sharing the target's tokenizer")
    return inputs.draft_model


def _build_recycling(inputs: ProposerInputs) -> ProposerBase:
    if inputs.recycling is None:
        raise ValueError("method 'recycling' needs the target's recycling matrix (build_decoder makes one)")
    return RecyclingProposer(inputs.recycling, **inputs.options)


def _history(inputs: ProposerInputs) -> Any:
    """The response history, None when the caller turned it off (`history=False`) or gave none."""
    return None if inputs.history is False else inputs.history


def _build_suffix(inputs: ProposerInputs) -> ProposerBase:
    history = _history(inputs)
    if history is None:
        raise ValueError("method 'suffix' needs a response history (build_decoder makes an empty one)")
    return SuffixProposer(history, **inputs.options)


def _self_draft_target(name: str, inputs: ProposerInputs) -> Any:
    if inputs.target_model is None:
        raise ValueError(f"method {name!r} drafts with the target's own layers: pass target_model")
    return inputs.target_model


def _build_eesd(inputs: ProposerInputs) -> ProposerBase:
    from rasd.decoding.proposers.early_exit import make_eesd

    return make_eesd(_self_draft_target("eesd", inputs), **inputs.options)


def _build_adaeagle(inputs: ProposerInputs) -> ProposerBase:
    from rasd.decoding.proposers.early_exit import make_adaeagle

    return make_adaeagle(_self_draft_target("adaeagle", inputs), draft_model=inputs.draft_model, **inputs.options)


def _build_eagle(inputs: ProposerInputs) -> ProposerBase:
    """The target's EAGLE head (`eagle=` a file, else the trained or shipped one for `model_name`)."""
    from rasd.decoding.model.eagle_head import shared_head
    from rasd.decoding.proposers.eagle import EagleProposer

    options = dict(inputs.options)
    head = options.pop("head", None)
    path, name = options.pop("eagle", None), options.pop("model_name", "default")
    if head is None:
        head = shared_head(_self_draft_target("eagle", inputs), path, name)
    return EagleProposer(head, **options)


# ---------------------------------------------------------------------------------------------- configure


def rasd_head_by_default(model_name: str) -> bool:
    """Whether `rasd` without a draft model drafts with `model_name`'s EAGLE head: whenever it has one (`rasd:head=off`
    turns it off; docs/methods.md says why). Draft workers load what this says too
    (`rasd.distributed.draft_worker.worker_spec`)."""
    from rasd.decoding.model.eagle_head import head_path

    return head_path(model_name).exists()


def _configure_rasd(setup: DecoderSetup) -> None:
    """Recycle when the curve is flat; with a draft model, its chain stops where p̂ < δ (cost sizing)."""
    from rasd.decoding.sizing.cost import curve_is_flat

    options, curve_for = setup.options, setup.curve_for
    use_head, head_file = options.pop("head", RasdOptions.head), options.pop("eagle", None)
    if head_file is not None and (use_head != "auto" or setup.draft is not None):
        raise ValueError("rasd: an EAGLE head file was given, but this rasd drafts with no head "
                         "(head=off or a --draft-model)")
    if setup.draft is None and "draft_proposer" not in options and use_head == "auto":
        head_options: dict[str, Any] = {"min_prob": None} if setup.sizing == "cost" else {}
        if setup.sizing == "cost":
            head_options["target_step_s"] = lambda n: curve_for(n).latency(1)
        head = _target_head(setup, head_file, **head_options)
        if head is not None:
            options["draft_proposer"] = head
    if setup.sizing != "cost":
        return
    options.setdefault("flat_curve", lambda n: curve_is_flat(curve_for(n)))   # recycle every step where it is flat
    if setup.draft is not None and "draft_options" not in options:
        options["draft_options"] = {"min_prob": None, "target_step_s": lambda n: curve_for(n).latency(1)}


def _target_head(setup: DecoderSetup, path: str | None = None, **options: Any) -> ProposerBase | None:
    """The EAGLE head at `path` as a draft (missing: an error), else the target's own (trained here or
    shipped), or None when it has none."""
    from rasd.decoding.model.eagle_head import head_path, shared_head
    from rasd.decoding.proposers.eagle import EagleProposer

    if path is None and not head_path(setup.target.name).exists():
        return None
    return EagleProposer(shared_head(setup.target.model, path, setup.target.name), **options)


def _configure_optree(setup: DecoderSetup) -> None:
    """δ from the measured plain step and a node cap from the curve; without a draft model, the self-draft."""
    from rasd.decoding.model.loading import SELF_DRAFT as SELF_DRAFT_SPEC
    from rasd.decoding.model.loading import load_draft
    from rasd.decoding.sizing.cost import flat_nodes

    options, curve_for = setup.options, setup.curve_for
    if setup.sizing == "cost":
        options.setdefault("target_step_s", lambda context_len: curve_for(context_len).latency(1))
        options.setdefault("node_cap", lambda context_len: flat_nodes(curve_for(context_len)))
    if setup.draft is None:
        setup.draft = load_draft(SELF_DRAFT_SPEC, setup.target, options.pop("eesd", None))


def _configure_head(setup: DecoderSetup) -> None:
    """The head drafts from the target's own features: it needs the target, never a second model. With cost
    sizing a branch grows while its p̂ beats δ = head forward / target step (as OPT-Tree's δ)."""
    setup.draft = None
    setup.options.setdefault("target_model", setup.target.model)
    setup.options.setdefault("model_name", setup.target.name)
    if setup.sizing == "cost":
        curve_for = setup.curve_for
        setup.options.setdefault("min_prob", None)
        setup.options.setdefault("target_step_s", lambda n: curve_for(n).latency(1))


def _configure_adaeagle(setup: DecoderSetup) -> None:
    """adaeagle's drafter: the given draft model, the self-draft for `--draft-model eesd`, else the EAGLE head."""
    if setup.draft is None:
        setup.options.setdefault("drafter", "eagle")
    elif is_self_draft(setup.draft.name):
        setup.draft = None
        setup.options.setdefault("drafter", "eesd")
    setup.options.setdefault("target_model", setup.target.model)
    setup.options.setdefault("model_name", setup.target.name)


def _configure_self_draft(setup: DecoderSetup) -> None:
    """eesd / adaeagle draft with the target's own layers: `--draft-model eesd` means exactly that."""
    if setup.draft is not None and is_self_draft(setup.draft.name):
        setup.draft = None
    setup.options.setdefault("target_model", setup.target.model)
    setup.options.setdefault("model_name", setup.target.name)


# ---------------------------------------------------------------------------------------------- the registry

_SPECS = (
    MethodSpec("ar", "plain autoregressive decoding in this engine (the baseline)",
               lambda i: NoDraftProposer(), speculates=False),
    MethodSpec("pld", "prompt lookup: n-gram matches in the prompt and output",
               lambda i: PromptLookupProposer(**i.options), options=PldOptions),
    MethodSpec("draft", "a small draft model's tree",
               lambda i: DraftModelProposer(_needs_draft("draft", i), **i.options),
               draft=REQUIRED_DRAFT, gate_block=8, options=DraftOptions),
    MethodSpec("optree", "OPT-Tree: the draft tree maximising expected acceptance under a node budget",
               lambda i: DraftModelProposer(_needs_draft("optree", i), shape="optree", **i.options),
               draft=SELF_BY_DEFAULT, gate_block=8, configure=_configure_optree, options=OptreeOptions),
    MethodSpec("retrieval", "REST: continuations from the index's suffix arrays and the context",
               lambda i: RetrievalProposer(i.datastores, **i.options), uses_index=True, options=RetrievalOptions),
    MethodSpec("recycling", "Token Recycling: a tree grown from the target's own earlier top-k (adjacency matrix)",
               _build_recycling, uses_recycling=True, options=RecyclingOptions),
    MethodSpec("rasd", "RASD: retrieval tree pruned by the draft, fused with it and recycled tokens",
               lambda i: RasdProposer(i.datastores, draft_model=i.draft_model, recycling=i.recycling,
                                      history=_history(i), **i.options),
               draft=OPTIONAL_DRAFT, uses_index=True, uses_recycling=True, uses_history=True, gate_block=4,
               configure=_configure_rasd, remote_draft=True, options=RasdOptions),
    MethodSpec("suffix", "SuffixDecoding: drafts from earlier responses", _build_suffix, uses_history=True,
               options=SuffixOptions),
    MethodSpec("eagle", "EAGLE-2: dynamic draft trees from the target's trained feature-level head",
               _build_eagle, draft=HEAD, gate_block=8, configure=_configure_head, options=EagleOptions),
    MethodSpec("eesd", "EESD: the target's first layers + a trained exit layer, Thompson-sampled length",
               _build_eesd, draft=SELF_DRAFT, gate_block=8, configure=_configure_self_draft, options=EesdOptions),
    MethodSpec("adaeagle", "AdaEAGLE: a trained predictor of the draft length (LDLP) over the EAGLE head",
               _build_adaeagle, draft=HEAD_BY_DEFAULT, gate_block=8, needs_ldlp=True,
               configure=_configure_adaeagle, options=AdaeagleOptions),
)
METHODS: dict[str, MethodSpec] = {spec.name: spec for spec in _SPECS}


def method_spec(name: str) -> MethodSpec:
    """The spec of a method name; ValueError listing the choices otherwise."""
    spec = METHODS.get(name)
    if spec is None:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
    return spec


def method_variant(name: str) -> tuple[str, dict[str, Any]]:
    """`rasd:history=off` -> ("rasd", {"history": False}): a method with options changed, so that it runs beside
    the plain one in the same benchmark; each key and value checked against the method's `options` class
    (ValueError, one line, on an unknown method, key or a bad value)."""
    return parse_variant(name, lambda method: method_spec(method).options)


def make_proposer(method: str, draft_model: Any = None, datastores: list[Any] | None = None,
                  recycling: Any = None, target_model: Any = None, history: Any = None, **options: Any) -> ProposerBase:
    """Build the proposer for a method name (see `ProposerInputs` for the arguments); a clear ValueError
    for unknown names or a missing draft model / recycling matrix / target / response history."""
    inputs = ProposerInputs(draft_model, datastores, recycling, target_model, options, history)
    return method_spec(method).build(inputs)
