"""The index split over `RetrievalShard` Ray actors, behind the same duck-typed interface as `Index`.

Why actors: a corpus whose FAISS vectors and token suffix arrays do not fit one node (or whose lookups
should not compete with the verifier for its cores) is split by segment; each shard owns some segments and
answers vector searches, datastore lookups and document fetches for them. `ShardedIndex` fans a query out
to every shard at once and merges, so the service and the proposers cannot tell it from an in-process
`Index`: `search`, `search_vectors`, `datastores()`, `document_tokens`, the counts and the manifest.

Failure policy. Vector search is part of the answer (its chunks go into the prompt), so a search waits for a
restarted shard (actors restart, and calls are retried, up to `max_restarts`). A datastore lookup only
proposes draft tokens, which the target verifies anyway: when a shard is down or slow, `RemoteDatastore`
returns "no match" at once and counts the miss. Decoding then goes on with fewer drafts — never a wrong
token, never a hang.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rasd.errors import ApiError
from rasd.index.manifest import read_manifest_stamped
from rasd.index.store import Hit, Index, IndexReader

LOOKUP_TIMEOUT_S = 0.5     # a lookup slower than this costs more than the drafts it could give
CALL_TIMEOUT_S = 30.0      # a vector search or document fetch: a request waits this long, then gets a 503
START_TIMEOUT_S = 120.0    # shards loading their segments at start-up or after an ingest


class RetrievalShard:
    """One shard: some segments of one index (run as a Ray actor; plain class for in-process tests)."""

    def __init__(self, root: str, segments: Sequence[str]):
        self.root = root
        self.index = Index.open(root, segments=list(segments))

    def segment_names(self) -> list[str]:
        return [s.name for s in self.index.segments]

    def search_vectors(self, query_vectors: np.ndarray, k: int) -> list[list[Hit]]:
        return self.index.search_vectors(query_vectors, k)

    def lookup(self, tail: list[int], max_continuations: int, length: int, max_len: int,
               min_len: int) -> tuple[int, list[list[int]]]:
        """The longest suffix match over this shard's segments; continuations of every segment matching it."""
        best, conts = 0, []
        for store in self.index.datastores():
            n, found = store.lookup(tail, max_continuations, length, max_len, min_len)
            if n > best:
                best, conts = n, list(found)
            elif n == best and n > 0:
                conts += found
        return best, conts[:max_continuations]

    def document_tokens(self, doc_ids: Sequence[int]) -> list[list[int]]:
        return self.index.document_tokens(doc_ids)

    def documents(self, doc_ids: Sequence[int]) -> list[Any]:
        return self.index.documents(doc_ids)

    def pid(self) -> int:
        import os

        return os.getpid()


@dataclass
class LookupStats:
    """Datastore lookups served and missed (shard down or slower than the timeout)."""

    calls: int = 0
    misses: int = 0


class RemoteDatastore:
    """A shard's token datastores as one `SuffixArray`-like object (`lookup` only) for the proposers."""

    def __init__(self, actor: Any, timeout_s: float = LOOKUP_TIMEOUT_S, stats: LookupStats | None = None):
        self.actor, self.timeout_s = actor, timeout_s
        self.stats = stats or LookupStats()

    def lookup(self, context: list[int], max_continuations: int = 64, length: int = 8, max_len: int = 16,
               min_len: int = 2) -> tuple[int, list[list[int]]]:
        """Only the last `max_len` tokens travel; no answer in time = no match (drafts are optional)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        self.stats.calls += 1
        ref = self.actor.lookup.remote(list(context[-max_len:]), max_continuations, length, max_len, min_len)
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except (GetTimeoutError, RayError):
            self.stats.misses += 1
            ray.cancel(ref)
            return 0, []


def _get(refs: list[Any], timeout_s: float, what: str) -> list[Any]:
    """`ray.get` with a deadline: a shard that hangs (or keeps restarting) costs a request a clear 503, never
    an endless wait on the thread that runs every request's decoding."""
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError as exc:
        for ref in refs:
            ray.cancel(ref)
        raise ApiError(503, f"the retrieval shards did not finish {what} in {timeout_s:g} s; retry later",
                       "server_error") from exc


def assign_segments(names: Sequence[str], num_shards: int) -> list[list[str]]:
    """Round-robin segments over at most `num_shards` shards (never an empty shard)."""
    shards = max(1, min(num_shards, len(names)))
    return [list(names[i::shards]) for i in range(shards)]


class ShardedIndex(IndexReader):
    """`Index`'s read interface over `RetrievalShard` actors (see the module docstring)."""

    def __init__(self, root: str | Path, num_shards: int, actor_options: dict[str, Any] | None = None,
                 lookup_timeout_s: float = LOOKUP_TIMEOUT_S):
        self.root = Path(root)
        self.num_shards = num_shards
        self.actor_options = {"num_cpus": 0, "max_restarts": -1, "max_task_retries": -1, **(actor_options or {})}
        self.lookup_timeout_s = lookup_timeout_s
        self.lookups = LookupStats()
        self.actors: list[Any] = []
        self.refresh()

    # ------------------------------------------------------------------ lifecycle
    def refresh(self) -> None:
        """(Re)read the manifest and (re)start shards for its segments, e.g. after an ingest added one."""
        import ray

        manifest, stamp = read_manifest_stamped(self.root)
        Index.open(self.root)       # validates the committed state (one-line error when missing/corrupt)
        self.close()
        self.manifest, self.stamp = manifest, stamp    # the stamp of what the shards serve (IndexHolder)
        names = [e["name"] for e in manifest["segments"]]
        self.assignment = assign_segments(names, self.num_shards)
        remote = ray.remote(RetrievalShard).options(**self.actor_options)
        self.actors = [remote.remote(str(self.root), seg) for seg in self.assignment]
        _get([a.segment_names.remote() for a in self.actors], START_TIMEOUT_S, "starting")   # fail here, not later
        entries = {e["name"]: e for e in manifest["segments"]}
        self._doc_ranges = [[(int(entries[n]["doc_id_start"]), int(entries[n]["num_documents"])) for n in seg]
                            for seg in self.assignment]

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []

    # ------------------------------------------------------------------ description (as Index)
    @property
    def num_documents(self) -> int:
        return sum(int(e["num_documents"]) for e in self.manifest["segments"])

    @property
    def num_chunks(self) -> int:
        return sum(int(e["num_chunks"]) for e in self.manifest["segments"])

    @property
    def num_tokens(self) -> int:
        return sum(int(e["num_tokens"]) for e in self.manifest["segments"])

    def __repr__(self) -> str:
        return f"ShardedIndex({str(self.root)!r}, shards={len(self.actors)}, documents={self.num_documents})"

    # ------------------------------------------------------------------ search
    def search_vectors(self, query_vectors: np.ndarray, k: int) -> list[list[Hit]]:
        """Every shard searches at once; the k best over all of them, ties by chunk id (as `Index`)."""

        per_shard = _get([a.search_vectors.remote(query_vectors, k) for a in self.actors], CALL_TIMEOUT_S,
                         "searching")
        out = []
        for qi in range(len(query_vectors)):
            hits = [h for shard in per_shard for h in shard[qi]]
            hits.sort(key=lambda h: (-h.score, h.chunk_id))
            out.append(hits[:k])
        return out

    # ------------------------------------------------------------------ datastores and documents
    def datastores(self) -> list[RemoteDatastore]:
        return [RemoteDatastore(a, self.lookup_timeout_s, self.lookups) for a in self.actors]

    def _shard_of(self, doc_id: int) -> int:
        for i, ranges in enumerate(self._doc_ranges):
            if any(start <= doc_id < start + n for start, n in ranges):
                return i
        raise KeyError(f"no document with id {doc_id} in {self.root} (ids 0..{self.num_documents - 1})")

    def document_tokens(self, doc_ids: Sequence[int]) -> list[list[int]]:
        return self._by_shard("document_tokens", doc_ids)

    def documents(self, doc_ids: Sequence[int]) -> list[Any]:
        return self._by_shard("documents", doc_ids)

    def _by_shard(self, method: str, doc_ids: Sequence[int]) -> list[Any]:
        """One call per shard holding any of the ids, in parallel; results in the order asked."""
        groups: dict[int, list[int]] = {}
        for d in doc_ids:
            groups.setdefault(self._shard_of(int(d)), []).append(int(d))
        refs = {i: getattr(self.actors[i], method).remote(ids) for i, ids in groups.items()}
        answers = _get(list(refs.values()), CALL_TIMEOUT_S, f"reading {method}")
        found = {i: dict(zip(groups[i], res, strict=True)) for i, res in zip(refs, answers, strict=True)}
        return [found[self._shard_of(int(d))][int(d)] for d in doc_ids]

    def check_tokenizer(self, tokenizer: Any) -> None:
        from rasd.index.store import check_tokenizer

        check_tokenizer(self.manifest, tokenizer)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Block until every shard answers (after a restart), or raise TimeoutError."""
        import ray

        deadline = time.monotonic() + timeout_s
        ray.get([a.segment_names.remote() for a in self.actors], timeout=max(deadline - time.monotonic(), 0.1))
