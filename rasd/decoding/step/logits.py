"""Logits processors (penalties, logit bias) applied to every tree node from its own path.

Why per node: a draft node's logits are the target's distribution after the committed text *and that node's
path*. Plain decoding with a repetition penalty would have seen the path's tokens as already written, so the
verifier must penalise them too, node by node; then speculative decoding under penalties still equals plain
decoding under the same penalties, greedy and sampled (the accepted path's processed distributions are exactly
plain decoding's).

Semantics follow vLLM / OpenAI / HF, in vLLM's order:
- `logit_bias`: added to the raw logits (OpenAI: -100..100 per token id).
- `repetition_penalty` (HF, vLLM): every token of the prompt or the output so far: logit / r when positive,
  logit * r otherwise.
- `frequency_penalty`, `presence_penalty` (OpenAI, vLLM): over the output so far only:
  logit -= frequency * count + presence * (count > 0).
- `grammar` (`decoding.grammar`): tokens the grammar forbids after the node's path go to -inf, last.
Temperature, top-k and top-p come after (`sampling.target_probs`), as in HF and vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rasd.decoding.step.sampling import SamplingParams
from rasd.decoding.step.tree import DraftTree


class LogitsProcessors:
    """One request's processors; `apply` takes a tree's logits [T, V] and the committed context."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], tokenizer: Any = None):
        if params.grammar is not None and tokenizer is None:
            raise ValueError("a grammar needs the model's tokenizer")
        self.params = params
        self.prompt_len = len(prompt_ids)
        self._prompt = list(prompt_ids)
        self._tokenizer = tokenizer
        self._grammar: Any = None   # a `GrammarMask`, made at the first logits (it needs their width)
        self._cache: dict[tuple[str, torch.device, int], torch.Tensor] = {}

    @staticmethod
    def for_request(params: SamplingParams, prompt_ids: Sequence[int], tokenizer: Any = None
                    ) -> LogitsProcessors | None:
        """None when the request asks for no processing (the common case costs nothing)."""
        return LogitsProcessors(params, prompt_ids, tokenizer) if params.processes_logits else None

    def apply(self, logits: torch.Tensor, context: Sequence[int], tree: DraftTree | None = None) -> torch.Tensor:
        """Processed logits [T, V] (float32) of the nodes of `tree` (root = context[-1]; None: one row whose
        next token follows `context`, as at the prefill)."""
        p = self.params
        logits = logits.float()
        squeeze = logits.dim() == 1
        if squeeze:
            logits = logits[None]
        rows, vocab = logits.shape
        if p.logit_bias:
            logits = logits + self._bias(vocab, logits.device)
        if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
            out_counts = self._output_counts(context, tree, rows, vocab, logits.device)   # [T, V]
            if p.repetition_penalty != 1.0:
                seen = (out_counts > 0) | self._prompt_mask(vocab, logits.device)
                r = p.repetition_penalty
                logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
            if p.frequency_penalty or p.presence_penalty:
                logits = logits - p.frequency_penalty * out_counts - p.presence_penalty * (out_counts > 0).float()
        if p.grammar is not None:
            logits = self._grammar_mask(vocab).apply(logits, context[self.prompt_len:], tree)
        return logits[0] if squeeze else logits

    def forced_tokens(self, context: Sequence[int], vocab: int) -> list[list[int]]:
        """Token paths spelling what a grammar forces after `context` (none without a grammar)."""
        if self.params.grammar is None:
            return []
        return self._grammar_mask(vocab).forced(context[self.prompt_len:])

    def _grammar_mask(self, vocab: int) -> Any:
        if self._grammar is None:
            from rasd.decoding.step.grammar import GrammarMask

            self._grammar = GrammarMask(self.params.grammar, self._tokenizer, vocab)
        return self._grammar

    def _output_counts(self, context: Sequence[int], tree: DraftTree | None, rows: int, vocab: int,
                       device: torch.device) -> torch.Tensor:
        """[T, V] how often each token was written: the committed output, then each node's own path."""
        out = torch.tensor(list(context[self.prompt_len:]), dtype=torch.long, device=device)
        base = torch.bincount(out[out < vocab], minlength=vocab)[:vocab].float()
        counts = base[None].repeat(rows, 1)
        if tree is not None and len(tree) > 1:
            anc = tree.ancestor_mask()[:rows, 1:]                     # [T, T-1]: root excluded (already in context)
            node, ancestor = anc.nonzero(as_tuple=True)
            tokens = torch.tensor(tree.tokens[1:], dtype=torch.long)[ancestor]
            keep = tokens < vocab
            counts.index_put_((node[keep].to(device), tokens[keep].to(device)),
                              torch.ones(int(keep.sum()), device=device), accumulate=True)
        return counts

    def _prompt_mask(self, vocab: int, device: torch.device) -> torch.Tensor:
        key = ("prompt", device, vocab)
        if key not in self._cache:
            ids = torch.tensor([t for t in self._prompt if 0 <= t < vocab], dtype=torch.long)
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[ids] = True
            self._cache[key] = mask.to(device)
        return self._cache[key]

    def _bias(self, vocab: int, device: torch.device) -> torch.Tensor:
        key = ("bias", device, vocab)
        if key not in self._cache:
            bias = torch.zeros(vocab)
            for tok, value in self.params.logit_bias:
                if not 0 <= tok < vocab:
                    raise ValueError(f"logit_bias names token {tok}; this model's vocabulary has {vocab}")
                bias[tok] += value
            self._cache[key] = bias.to(device)
        return self._cache[key]

