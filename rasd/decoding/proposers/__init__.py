"""Proposers, one per file, all behind the small `Proposer` protocol; `make_proposer` picks one by name."""

from __future__ import annotations

from typing import Any

from rasd.decoding.proposers.ar import NoDraftProposer
from rasd.decoding.proposers.base import Proposer
from rasd.decoding.proposers.draft import DraftModelProposer
from rasd.decoding.proposers.pld import PromptLookupProposer
from rasd.decoding.proposers.rasd import RasdProposer
from rasd.decoding.proposers.recycling import RecyclingMatrix, RecyclingProposer
from rasd.decoding.proposers.retrieval import RetrievalProposer

METHODS = ("ar", "pld", "draft", "optree", "retrieval", "recycling", "rasd", "eesd", "adaeagle")


def make_proposer(method: str, draft_model: Any = None, datastores: list[Any] | None = None,
                  recycling: RecyclingMatrix | None = None, target_model: Any = None, **options: Any) -> Proposer:
    """Build the proposer for a method name; a clear error for unknown names or missing draft models.

    `datastores` (token suffix arrays) are used by `retrieval` and `rasd` and ignored by the others; `rasd`
    uses the draft model when one is given and works without one (see its module docstring). `recycling` (the
    target's shared Token Recycling matrix) feeds `recycling` (required) and `rasd` (optional source).
    `eesd` and `adaeagle` draft with the target's own layers (`target_model`) and trained weights
    (options `eesd=`, `ldlp=` paths, else the defaults under $RASD_HOME for `model_name=`).
    """
    if method == "ar":
        return NoDraftProposer()
    if method == "pld":
        return PromptLookupProposer(**options)
    if method == "draft":
        if draft_model is None:
            raise ValueError("method 'draft' needs a draft model (--draft-model) sharing the target's tokenizer")
        return DraftModelProposer(draft_model, **options)
    if method == "optree":
        if draft_model is None:
            raise ValueError("method 'optree' needs a draft model (--draft-model) sharing the target's tokenizer")
        return DraftModelProposer(draft_model, shape="optree", **options)
    if method == "retrieval":
        return RetrievalProposer(datastores, **options)
    if method == "recycling":
        if recycling is None:
            raise ValueError("method 'recycling' needs the target's recycling matrix (build_decoder makes one)")
        return RecyclingProposer(recycling, **options)
    if method == "rasd":
        return RasdProposer(datastores, draft_model=draft_model, recycling=recycling, **options)
    if method in ("eesd", "adaeagle"):
        from rasd.decoding.proposers.early_exit import make_adaeagle, make_eesd

        if target_model is None:
            raise ValueError(f"method {method!r} drafts with the target's own layers: pass target_model")
        if method == "eesd":
            return make_eesd(target_model, **options)
        return make_adaeagle(target_model, draft_model=draft_model, **options)
    raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")


__all__ = ["METHODS", "DraftModelProposer", "NoDraftProposer", "PromptLookupProposer", "Proposer", "RasdProposer",
           "RecyclingMatrix", "RecyclingProposer", "RetrievalProposer", "make_proposer"]
