"""FAISS vector indexes over chunk embeddings: flat (exact), IVF or HNSW, inner product on unit vectors.

Why flat is the default: at the sizes one machine indexes (up to a few hundred thousand chunks) exact search
takes milliseconds and needs no training; IVF and HNSW are there for bigger shards. IVF needs enough
vectors to train its nlist ≈ sqrt(n) centroids (FAISS wants ~39 per centroid), so with fewer it falls back
to flat and says so.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from rasd.index.errors import IndexInputError

log = logging.getLogger("rasd.index")

FAISS_KINDS = ("flat", "ivf", "hnsw")
MIN_POINTS_PER_CENTROID = 39   # FAISS warns below this; k-means with fewer points gives poor centroids
HNSW_M = 32


def ivf_nlist(n: int) -> int:
    """Number of IVF lists for n vectors: about sqrt(n)."""
    return max(1, int(round(math.sqrt(n))))


def build_vector_index(vectors: np.ndarray, kind: str = "flat") -> tuple[Any, str]:
    """(FAISS index holding `vectors` with ids 0..n-1, the kind actually built)."""
    import faiss

    if kind not in FAISS_KINDS:
        raise IndexInputError(f"unknown FAISS index kind {kind!r}; choose one of {', '.join(FAISS_KINDS)}")
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    n, dim = vectors.shape
    if kind == "ivf":
        nlist = ivf_nlist(n)
        if n < MIN_POINTS_PER_CENTROID * max(nlist, 2):
            log.warning("IVF needs at least %d vectors to train; this segment has %d, so it uses a flat index",
                        MIN_POINTS_PER_CENTROID * max(nlist, 2), n)
            kind = "flat"
        else:
            quantizer = faiss.IndexFlatIP(dim)
            index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
            index.train(vectors)
            index.nprobe = max(1, min(nlist, int(round(math.sqrt(nlist)))))
            index.add(vectors)
            return index, "ivf"
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efSearch = 64
        index.add(vectors)
        return index, "hnsw"
    index = faiss.IndexFlatIP(dim)
    index.add(vectors)
    return index, "flat"


def write_vector_index(index: Any, path: Path) -> None:
    """Write a (CPU) FAISS index file; FAISS's own format, no pickle."""
    import faiss

    faiss.write_index(index, str(path))


def read_vector_index(path: Path, use_gpu: bool | None = None) -> Any:
    """Read a FAISS index; moved to the GPU when FAISS has one (flat and IVF only: HNSW is CPU-only)."""
    import faiss

    index = faiss.read_index(str(path))
    if use_gpu is None:
        use_gpu = getattr(faiss, "get_num_gpus", lambda: 0)() > 0
    if use_gpu and not isinstance(index, faiss.IndexHNSW):
        try:
            index = faiss.index_cpu_to_all_gpus(index)
        except (AttributeError, RuntimeError) as exc:   # faiss-cpu, or an index type the GPU lacks
            log.info("FAISS GPU unavailable for %s (%s); searching on the CPU", path.name, exc)
    return index


def search_vectors(index: Any, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores [q, k'], ids [q, k']) with k' = min(k, ntotal); ids of missing results are dropped by callers (-1)."""
    k = min(k, int(index.ntotal))
    if k <= 0:
        q = len(queries)
        return np.zeros((q, 0), dtype=np.float32), np.zeros((q, 0), dtype=np.int64)
    scores, ids = index.search(np.ascontiguousarray(queries, dtype=np.float32), k)
    return scores, ids
