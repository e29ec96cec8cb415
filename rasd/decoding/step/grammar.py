"""Grammar-constrained decoding (JSON schema, `json_object`) with llguidance, exact under speculation.

Why per node: a tree node's distribution is the target's after the committed text and the node's own path, so
the grammar mask for its row is the matcher's after that same path. The matcher walks the tree depth first
(consume a child's token, fill its row, recurse, roll back one token), so constrained speculative decoding
picks exactly the tokens constrained plain decoding would: a draft token the grammar forbids has probability
0 under its parent's masked distribution and is never accepted. The committed output is fed to the matcher
lazily, at the next mask, so there is no commit hook to forget.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from rasd.decoding.step.tree import DraftTree

JSON_DEFAULTS = {"whitespace_flexible": False}   # compact JSON: a small model's whitespace cannot run away


def json_grammar(schema: dict[str, Any] | None) -> str:
    """The llguidance grammar of a JSON schema (None: any JSON object, OpenAI's `json_object`); ValueError
    with the reason when the schema is not one llguidance can compile."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema if schema is not None else {"type": "object"}),
                                                     defaults=JSON_DEFAULTS)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"the JSON schema cannot be compiled: {exc}") from exc
    problem = LLMatcher.validate_grammar(grammar)
    if problem:
        raise ValueError(f"the JSON schema cannot be compiled: {problem}")
    return grammar


# HF tokenizer -> (vocab, its llguidance view): kept beside the tokenizer, not on it, and gone with it
_LL_TOKENIZERS: weakref.WeakKeyDictionary[Any, tuple[int, Any]] = weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer: Any, vocab: int) -> Any:
    """llguidance's view of a HF fast tokenizer over `vocab` LM-head rows (built once per tokenizer)."""
    import llguidance.hf

    cached = _LL_TOKENIZERS.get(tokenizer)
    if cached is None or cached[0] != vocab:
        try:
            cached = (vocab, llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab))
        except Exception as exc:   # noqa: BLE001 - a slow (Python) tokenizer or one without byte tokens
            raise ValueError(f"grammars need a fast HF tokenizer ({type(exc).__name__}: {exc})") from exc
        _LL_TOKENIZERS[tokenizer] = cached
    return cached[1]


class GrammarMask:
    """One request's matcher; `apply` masks a tree's logits [T, V] row by row from each node's path."""

    def __init__(self, grammar: str, tokenizer: Any, vocab: int):
        import llguidance.torch as lt
        from llguidance import LLMatcher

        self._lt = lt
        self.vocab = vocab
        self.matcher_tokenizer = ll_tokenizer(tokenizer, vocab)
        self.matcher = LLMatcher(self.matcher_tokenizer, grammar)
        if self.matcher.is_error():
            raise ValueError(f"the grammar is invalid: {self.matcher.get_error()}")
        self.consumed = 0

    def sync(self, output: Sequence[int]) -> None:
        """Feed the committed output tokens the matcher has not seen yet."""
        for tok in output[self.consumed:]:
            if not self.matcher.is_stopped():
                self.matcher.consume_token(int(tok))
            self.consumed += 1

    def forced(self, output: Sequence[int], max_paths: int = 6) -> list[list[int]]:
        """Token paths spelling the bytes the grammar forces next (a JSON key and its `":`...), best first.

        The grammar fixes the bytes, not how the model splits them into tokens (`":"` or `":` + `"`), so the
        canonical tokenization comes first and a few other splits (longest tokens first) after it: drafts
        that plain decoding under the same grammar is likely to write, verified like any other."""
        self.sync(output)
        if self.matcher.is_stopped() or self.matcher.is_error():
            return []
        data = bytes(self.matcher.compute_ff_bytes())
        if not data:
            return []
        ll = self.matcher_tokenizer
        paths = [[int(t) for t in ll.tokenize_bytes(data)]]
        for path in segmentations(data, token_table(ll, self.vocab), max_paths):
            if path not in paths:
                paths.append(path)
        return paths[:max_paths]

    def apply(self, logits: torch.Tensor, output: Sequence[int], tree: DraftTree | None) -> torch.Tensor:
        """Forbidden tokens at -inf in every row whose path the grammar allows (other rows are never used)."""
        self.sync(output)
        rows = logits.shape[0]
        bitmask = self._lt.allocate_token_bitmask(rows, self.vocab)
        alive = [False] * rows
        self._fill(tree, 0, bitmask, alive)
        keep = torch.tensor(alive)
        masked = logits[keep].float().cpu().contiguous()
        self._lt.apply_token_bitmask_inplace(masked, bitmask[keep])
        out = logits.clone()
        out[keep.to(logits.device)] = masked.to(logits.device, logits.dtype)
        return out

    def _fill(self, tree: DraftTree | None, node: int, bitmask: torch.Tensor, alive: list[bool]) -> None:
        """Row `node`'s mask from the matcher's current state, then each allowed child's, depth first."""
        self._lt.fill_next_token_bitmask(self.matcher, bitmask, node)
        alive[node] = True
        if tree is None:
            return
        for child in tree.children(node):
            tok = tree.tokens[child]
            if self.matcher.is_stopped() or not allowed(bitmask, node, tok):
                continue   # never accepted: its parent's masked distribution gives it probability 0
            self.matcher.consume_token(tok)
            self._fill(tree, child, bitmask, alive)
            self.matcher.rollback(1)


def allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    """Whether `token` is allowed in row `row` of an llguidance bitmask [rows, ceil(V / 32)] (int32 words)."""
    word = int(bitmask[row, token >> 5]) & 0xFFFFFFFF
    return bool((word >> (token & 31)) & 1)


def token_table(ll: Any, vocab: int) -> dict[bytes, int]:
    """Bytes -> token id of every non-special token (built once per llguidance tokenizer)."""
    cached = _TABLES.get(id(ll))   # the tokenizers live as long as the process (`ll_tokenizer` keeps them)
    if cached is None:
        cached = {}
        for tok in range(min(vocab, ll.vocab_size)):
            if not ll.is_special_token(tok):
                cached.setdefault(bytes(ll.decode_bytes([tok])), tok)
        _TABLES[id(ll)] = cached
    return cached


_TABLES: dict[int, dict[bytes, int]] = {}


def segmentations(data: bytes, table: dict[bytes, int], limit: int, longest: int = 32) -> list[list[int]]:
    """Up to `limit` ways to write `data` as a sequence of tokens, longest first tokens first."""
    out: list[list[int]] = []

    def walk(at: int, path: list[int]) -> None:
        if len(out) >= limit:
            return
        if at == len(data):
            out.append(list(path))
            return
        for end in range(min(len(data), at + longest), at, -1):
            tok = table.get(data[at:end])
            if tok is not None:
                path.append(tok)
                walk(end, path)
                path.pop()
                if len(out) >= limit:
                    return

    walk(0, [])
    return out
