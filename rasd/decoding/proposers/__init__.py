"""Proposers, one per file, each a `ProposerBase` (the `Proposer` protocol's three methods plus optional hooks
with defaults, `base`); `registry` declares each method once (what it needs, how it is built, the options a
variant may set: `options`) and `make_proposer` builds one by name."""

from __future__ import annotations

from rasd.decoding.proposers.ar import NoDraftProposer
from rasd.decoding.proposers.base import Proposer, ProposerBase
from rasd.decoding.proposers.draft import DraftModelProposer
from rasd.decoding.proposers.pld import PromptLookupProposer
from rasd.decoding.proposers.rasd import RasdConfig, RasdProposer
from rasd.decoding.proposers.recycling import RecyclingMatrix, RecyclingProposer
from rasd.decoding.proposers.registry import METHODS, MethodSpec, make_proposer, method_spec
from rasd.decoding.proposers.retrieval import RetrievalProposer
from rasd.decoding.proposers.suffix import SuffixProposer

__all__ = ["METHODS", "DraftModelProposer", "MethodSpec", "NoDraftProposer", "PromptLookupProposer", "Proposer",
           "ProposerBase", "RasdConfig", "RasdProposer", "RecyclingMatrix", "RecyclingProposer", "RetrievalProposer",
           "SuffixProposer", "make_proposer", "method_spec"]
