"""Tokenizing documents with the TARGET model's tokenizer and cutting them into overlapping chunks.

Why the target tokenizer: the same token ids feed the suffix-array datastore, whose continuations are
proposed as draft tokens to that model; chunks cut on those tokens fit its context budget exactly.
Chunk text is a slice of the document by character offsets from the tokenizer, so it is exact (never
re-decoded text with spacing artefacts).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from rasd.index.errors import IndexInputError

_FINGERPRINTS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
# A fixed text whose token ids are part of the tokenizer fingerprint: two tokenizers with the same vocabulary
# but different merges or normalisation still tokenize it differently.
_PROBE = "Retrieval-augmented decoding, naïve café 12,345.67 — 東京 🙂\n\tdef f(x): return x**2  # ok"


@dataclass
class TokenizedDocument:
    """Token ids of a whole document and each token's [start, end) character span in its text."""

    ids: np.ndarray       # [n_tokens] int32
    offsets: np.ndarray   # [n_tokens, 2] int64


@dataclass
class Chunk:
    """A chunk of one document: token range [token_start, token_end) and its exact text span."""

    doc_index: int
    token_start: int
    token_end: int
    char_start: int
    char_end: int
    text: str


def resolve_tokenizer_path(name: str) -> str:
    """`default` is the embedded SmolLM2 (converted once); anything else is a hub id or local path."""
    if name == "default":
        from rasd.decoding.model.loading import default_model_path

        return str(default_model_path())
    return name


@lru_cache(maxsize=8)
def load_tokenizer(name: str) -> Any:
    """The HF tokenizer for a model name (`default`, hub id or path); cached because loading takes ~0.5 s."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(resolve_tokenizer_path(name))
    except Exception as exc:  # noqa: BLE001 - HF raises many types; the person needs one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise IndexInputError(f"cannot load the tokenizer of model {name!r}: {first}") from exc


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of the vocabulary and of the ids of a probe text: equal fingerprints tokenize alike.

    Why not the name: `default`, the converted folder's path, and a LoadedModel's tokenizer are one
    tokenizer under three names, while two checkpoints may share a name with different vocabularies.
    Cached per tokenizer object: hashing a 50k vocabulary takes ~0.1 s and callers check once per request.
    """
    try:
        return _FINGERPRINTS[tokenizer]
    except (KeyError, TypeError):
        pass
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    probe = list(tokenizer(_PROBE, add_special_tokens=False)["input_ids"])
    payload = json.dumps({"vocab": vocab, "probe": probe}, ensure_ascii=False).encode("utf-8")
    digest = hashlib.sha256(payload).hexdigest()[:32]
    with contextlib.suppress(TypeError):          # objects without weak references are just not cached
        _FINGERPRINTS[tokenizer] = digest
    return digest


def _ids_array(encoding: Any) -> np.ndarray:
    return np.asarray(encoding.ids, dtype=np.int32)                      # [n_tokens]


def _offsets_array(encoding: Any) -> np.ndarray:
    flat = itertools.chain.from_iterable(encoding.offsets)
    return np.fromiter(flat, dtype=np.int64, count=2 * len(encoding)).reshape(-1, 2)   # [n_tokens, 2]


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _encode_batch(tokenizer: Any, batch: list[str]) -> list[Any]:
    """Rust encodings of `batch` without special tokens; the Rust tokenizer releases the GIL while it works.

    Falls back to the Python wrapper when the backend has truncation or padding configured (the wrapper
    turns those off per call; the backend alone would apply them)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.truncation is None and backend.padding is None:
        return backend.encode_batch(batch, add_special_tokens=False)
    return tokenizer(batch, add_special_tokens=False, return_offsets_mapping=True).encodings


def tokenize_documents(tokenizer: Any, texts: Sequence[str], progress: bool = False, batch_size: int = 64,
                       run_python: Callable[..., Any] | None = None) -> list[TokenizedDocument]:
    """Token ids and character offsets of whole documents, without special tokens (no BOS in the datastore).

    `run_python(fn, *args)`: where the GIL-bound conversion of each encoding to arrays runs (a service's
    compute thread, as background work). Why: Python work on a second thread slows every torch op of the
    decoding thread, which must win the GIL back after each op (seen: a 2.4 s stall in a 10 MB ingest).
    """
    from tqdm.auto import tqdm

    if not getattr(tokenizer, "is_fast", False):
        raise IndexInputError(f"the tokenizer {type(tokenizer).__name__} is not a fast tokenizer; "
                              "character offsets (needed for exact chunk text) need one")
    run = run_python or _call
    out: list[TokenizedDocument] = []
    with tqdm(total=len(texts), desc="tokenizing", unit="doc", disable=not progress) as bar:
        for i in range(0, len(texts), batch_size):
            for encoding in _encode_batch(tokenizer, list(texts[i:i + batch_size])):
                out.append(TokenizedDocument(run(_ids_array, encoding), run(_offsets_array, encoding)))
                bar.update(1)
    return out


def chunk_spans(n_tokens: int, chunk_tokens: int, overlap: int) -> list[tuple[int, int]]:
    """[start, end) token windows of `chunk_tokens` advancing by chunk_tokens - overlap.

    The last window always holds tokens no earlier window had (a tail made only of overlap is dropped).
    """
    if chunk_tokens < 1 or not 0 <= overlap < chunk_tokens:
        raise IndexInputError(f"need chunk_tokens >= 1 and 0 <= overlap < chunk_tokens "
                              f"(got {chunk_tokens}, {overlap})")
    if n_tokens == 0:
        return []
    step = chunk_tokens - overlap
    spans = []
    start = 0
    while True:
        end = min(start + chunk_tokens, n_tokens)
        spans.append((start, end))
        if end >= n_tokens:
            return spans
        start += step


def chunk_document(doc_index: int, text: str, tokens: TokenizedDocument, chunk_tokens: int,
                   overlap: int) -> list[Chunk]:
    """Chunks of one tokenized document; text spans run from the first token's start to the last's end."""
    chunks = []
    for start, end in chunk_spans(len(tokens.ids), chunk_tokens, overlap):
        c0 = int(tokens.offsets[start:end, 0].min())
        c1 = int(tokens.offsets[start:end, 1].max())
        chunks.append(Chunk(doc_index, start, end, c0, c1, text[c0:c1]))
    return chunks
