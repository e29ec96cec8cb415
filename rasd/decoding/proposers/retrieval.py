"""`retrieval`: REST-style drafts from token datastores, the request's documents and its own context.

Three sources, each a counted trie of retrieved continuations (the node score is the share of continuations
through the node):
- "datastore": every `SuffixArray` given at construction (the whole index). The longest suffix of the
  context (16 down to 2 tokens) that occurs is looked up; up to `max_continuations` of its occurrences give
  continuations of up to `length` tokens.
- "documents": the same lookup in a small suffix array over the documents vector retrieval returned for
  this request (`scope`). Their text is the likeliest to be quoted in the answer.
- "context": prompt lookup in the prompt + generated text (the `pld` proposer's incremental n-gram index).
The tries are merged into one tree by longest-prefix grafting, the longest match first (its source tag wins
on shared nodes), and the `max_nodes` best-scored nodes are kept. `tree.bucket` is the longest match's
length class: the cost-aware sizer learns acceptance rates per bucket, and longer matches are accepted more
often. With no datastore and no scope this is prompt lookup.

Defaults (`max_continuations=16`, `length=8`) were measured with `bench/measure_retrieval.py`: embedded
SmolLM2-135M, CPU (2 cores, another process often busy), 4 LongBench rows (multifieldqa_en, qasper,
gov_report), prompt = the first 1000 tokens of a row's document + its question, datastore = the 4 whole
documents (24k tokens), request scoped to its own, 64 greedy tokens, cost-aware sizing. Mean accepted tokens
(decode tokens/s; `ar` 13.3, `pld` 1.54 / 11.7): N16 L8 1.60 (12.0), N64 L8 1.45 (10.4), N16 L16 1.54
(10.8), N8 L4 1.41 (10.2). More continuations add rarely-right branches, longer ones rarely-reached depth;
fewer or shorter ones lose accepted tokens. The context source keeps `pld`'s 10-token continuations
(`context_length`): with 8, `rasd` capped long copies from the prompt one token short of `pld` (LongBench
docqa: 33 steps accepted 8 tokens where `pld` accepted 9 in 25), so `rasd` without its drafter and extra
sources is `pld` (with a drafter it copies from matches of 2+ tokens only: `proposers.rasd`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from rasd.decoding.drafting.fusion import merge_trees
from rasd.decoding.proposers.base import ProposerBase
from rasd.decoding.proposers.pld import PromptLookupProposer, counted_trie
from rasd.decoding.step.sampling import SamplingParams
from rasd.decoding.step.tree import DraftTree
from rasd.decoding.step.verify import Verdict

if TYPE_CHECKING:   # the index package may pull in heavy deps (FAISS); import it lazily
    from rasd.index.suffix_array import SuffixArray

DATASTORE, DOCUMENTS, CONTEXT = "datastore", "documents", "context"
SOURCE_ORDER = {DOCUMENTS: 0, CONTEXT: 1, DATASTORE: 2}   # tie-break between equally long matches


def match_class(n: int) -> int:
    """Coarse match-length class: 1, 2, 3, then 4-7 → 4, 8-15 → 8, 16+ → 16.

    Acceptance grows with match length but flattens out; few classes let the sizer learn each one quickly.
    """
    return n if n < 4 else 1 << (n.bit_length() - 1)


class RetrievalProposer(ProposerBase):
    """Datastore + scoped documents + prompt lookup, merged into one counted tree."""

    name = "retrieval"

    def __init__(self, datastores: Sequence[SuffixArray] | None = None, max_continuations: int = 16,
                 length: int = 8, max_match: int = 16, min_match: int = 2, use_context: bool = True,
                 context_max_ngram: int = 4, context_min_ngram: int = 1, context_matches: int = 8,
                 context_length: int = 10):
        self.datastores = list(datastores or [])
        self.max_continuations, self.length = max_continuations, length
        self.max_match, self.min_match = max_match, min_match
        self.context = (PromptLookupProposer(max_ngram=context_max_ngram, min_ngram=context_min_ngram,
                                             max_len=context_length, max_matches=context_matches, source=CONTEXT)
                        if use_context else None)
        self.documents: SuffixArray | None = None

    def scope(self, doc_tokens: Sequence[Sequence[int]] | None) -> None:
        """Restrict the "documents" source to these token lists (this request's retrieved documents).

        The whole datastore is still searched too. The scope holds until the next call; `None` (or no
        non-empty document) removes it.
        """
        from rasd.index.suffix_array import SuffixArray

        docs = [d for d in doc_tokens or [] if len(d)]      # lists or int arrays
        self.documents = SuffixArray.from_documents(docs) if docs else None

    def set_datastores(self, datastores: Sequence[SuffixArray] | None) -> None:
        """Replace the whole-index datastores (e.g. after an ingest, or per benchmark row)."""
        self.datastores = list(datastores or [])

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        if self.context is not None:
            self.context.start(prompt_ids, sampling)

    def propose(self, context: list[int], max_nodes: int) -> DraftTree:
        if max_nodes <= 0:
            return DraftTree.root_only(context[-1])
        trees = self.candidate_trees(context, max_nodes)
        tree = merge_trees(context[-1], trees, max_nodes)
        tree.bucket = match_class(trees[0].bucket) if trees else 0
        return tree

    def observe(self, context: list[int], tree: DraftTree, verdict: Verdict, logits: torch.Tensor) -> None:
        """Lookups are stateless; the context index catches up in `propose`."""

    def candidate_trees(self, context: list[int], max_nodes: int) -> list[DraftTree]:
        """One counted trie per source that matched, longest match first; `bucket` = raw match length."""
        out = []
        for source, store in self._stores():
            match_len, conts = store.lookup(context, self.max_continuations, self.length, self.max_match,
                                            self.min_match)
            if conts:
                tree = counted_trie(context[-1], conts, source, max_nodes)
                tree.bucket = match_len
                out.append(tree)
        if self.context is not None:
            tree = self.context.propose(context, max_nodes)
            if tree.num_draft_tokens:
                out.append(tree)
        out.sort(key=lambda t: (-t.bucket, SOURCE_ORDER.get(t.sources[1], 3)))
        return out

    def _stores(self) -> Iterator[tuple[str, SuffixArray]]:
        if self.documents is not None:
            yield DOCUMENTS, self.documents
        for store in self.datastores:
            yield DATASTORE, store
