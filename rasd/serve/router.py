"""Prefix-aware request routing: send a request to the replica that already served its prompt's prefix.

Why: each replica keeps its own prefix cache (K/V of earlier prompts) and its own response history; a chat's
next turn and a repeated document question only find them on the replica that served the first. Serve's
default router (power of two choices) spreads them at random.

`PrefixTable` is the pure part: prompt texts cut into blocks of BLOCK_CHARS characters, each block keyed by a
hash chained over every block before it (as vLLM keys its prefix-cache blocks), so a key means "this whole
prefix"; every key remembers the replicas that were sent it, and the tails (shorter than a block) that
followed it, so prefixes match to the character; least recently used keys are dropped first.
`PrefixAffinityRouter` is the Ray Serve request router around it: the replica holding the longest prefix,
unless it has `imbalance` more requests in flight than the least loaded one; everything else goes to the
least loaded. The ingress reads the decision counters (`shared_state().snapshot()`) for `/metrics`.
"""

from __future__ import annotations

import hashlib
import importlib
import random
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

BLOCK_CHARS = 64          # characters per prefix block
MAX_KEYS = 200_000        # prefix blocks remembered (x ~100 bytes each)
IMBALANCE = 4             # requests in flight a matching replica may have beyond the least loaded one
MAX_PENDING = 10_000      # routing decisions (and ends) kept for requests not yet routed


def prefix_keys(text: str, block: int = BLOCK_CHARS) -> tuple[list[str], str]:
    """Keys of `text`'s whole blocks (each hashed over every block before it: a key stands for the whole
    prefix up to its block's end) and the tail after the last whole block."""
    keys: list[str] = []
    digest = hashlib.blake2b(digest_size=12)
    whole = len(text) - len(text) % block
    for start in range(0, whole, block):
        digest.update(text[start:start + block].encode("utf-8", "surrogatepass"))
        keys.append(digest.copy().hexdigest())
    return keys, text[whole:]


@dataclass
class _Node:
    """Replicas holding the prefix up to one block's end, and those holding it plus a shorter tail."""

    holders: set[str] = field(default_factory=set)
    tails: dict[str, set[str]] = field(default_factory=dict)


class PrefixTable:
    """Which replicas were sent which prompt prefixes, to the character (bounded: least recently used blocks
    evicted). A short question is a tail of the root; a chat's next turn extends its last turn's tail."""

    ROOT = ""

    def __init__(self, max_keys: int = MAX_KEYS, block: int = BLOCK_CHARS):
        self.max_keys, self.block = max_keys, block
        self._nodes: OrderedDict[str, _Node] = OrderedDict({self.ROOT: _Node()})
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._nodes) - 1

    def match(self, text: str, replicas: Iterable[str]) -> dict[str, int]:
        """Characters of `text`'s longest remembered prefix per replica among `replicas` (absent: none)."""
        wanted, found = set(replicas), {}
        keys, _ = prefix_keys(text, self.block)
        with self._lock:
            node, pos = self._nodes[self.ROOT], 0
            for key in keys:
                child = self._nodes.get(key)
                if child is None or not child.holders & wanted:
                    break
                self._nodes.move_to_end(key)
                node, pos = child, pos + self.block
                found.update(dict.fromkeys(child.holders & wanted, pos))
            for length in range(min(self.block - 1, len(text) - pos), 0, -1):
                holders = node.tails.get(text[pos:pos + length])
                for replica in (holders or set()) & wanted:
                    found[replica] = max(found.get(replica, 0), pos + length)
        return found

    def insert(self, text: str, replica: str) -> None:
        """Remember that `replica` now holds every prefix of `text`."""
        keys, tail = prefix_keys(text, self.block)
        with self._lock:
            node = self._nodes[self.ROOT]
            for key in keys:
                node = self._nodes.setdefault(key, _Node())
                node.holders.add(replica)
                self._nodes.move_to_end(key)
            if tail:
                node.tails.setdefault(tail, set()).add(replica)
            while len(self._nodes) > self.max_keys + 1:
                oldest = next(iter(self._nodes))
                if oldest == self.ROOT:
                    self._nodes.move_to_end(self.ROOT)
                    continue
                del self._nodes[oldest]
            if len(self._nodes[self.ROOT].tails) > self.max_keys:     # short texts only: drop the oldest
                root_tails = self._nodes[self.ROOT].tails
                del root_tails[next(iter(root_tails))]

    def remove_replica(self, replica: str) -> None:
        """Forget a replica that died (its cache died with it)."""
        with self._lock:
            for key in list(self._nodes):
                node = self._nodes[key]
                node.holders.discard(replica)
                for tail in [t for t, holders in node.tails.items() if replica in holders]:
                    node.tails[tail].discard(replica)
                    if not node.tails[tail]:
                        del node.tails[tail]
                if key != self.ROOT and not node.holders and not node.tails:
                    del self._nodes[key]


def choose(matches: dict[str, int], loads: dict[str, int], imbalance: int = IMBALANCE) -> tuple[str | None, str]:
    """The replica for a request and why: ("hit") the longest match if it is not `imbalance` requests busier
    than the least loaded replica, ("busy") no replica when the match is too busy, ("miss") none matched."""
    if not matches:
        return None, "miss"
    least = min(loads.values(), default=0)
    best = max(matches, key=lambda r: (matches[r], -loads.get(r, 0)))
    if loads.get(best, 0) - least > imbalance:
        return None, "busy"
    return best, "hit"


class RouterState:
    """What the routers of one process share: Serve makes a router per handle (a streaming and a plain handle
    of the same deployment are two), and both must see the same prefixes and loads."""

    def __init__(self) -> None:
        self.table = PrefixTable()
        self.imbalance = IMBALANCE
        self.lock = threading.Lock()
        self.in_flight: dict[str, int] = {}
        self.routed: dict[str, str] = {}                          # internal request id -> replica
        self.streams: dict[str, str] = {}                         # open stream's id -> replica
        self.stream_requests: set[str] = set()                    # internal ids of streams (Serve ends them early)
        self.ended: OrderedDict[str, None] = OrderedDict()        # ids that ended before they were routed
        self.decided: dict[str, tuple[str, str | None]] = {}      # internal request id -> (outcome, replica)
        self.decisions = {"hit": 0, "miss": 0, "busy": 0}
        self.replicas: list[str] = []

    def configure(self, imbalance: int, max_keys: int, block_chars: int) -> None:
        self.imbalance = imbalance
        if (max_keys, block_chars) != (self.table.max_keys, self.table.block):
            self.table = PrefixTable(max_keys, block_chars)

    def decide(self, request_id: str, route: str, loads: dict[str, int]) -> str | None:
        """The replica for a request with a route text (None: the least loaded), remembered until it is routed."""
        chosen, outcome = choose(self.table.match(route, loads), loads, self.imbalance)
        with self.lock:
            if len(self.decided) > MAX_PENDING:                    # requests cancelled before they were routed
                self.decided.clear()
            self.decided[request_id] = (outcome, chosen)
        return chosen

    def routed_to(self, request_id: str, replica: str, route: str | None, stream: str | None = None) -> None:
        """A request went to `replica`: count it in flight; its route's prefixes are that replica's now.

        A stream (`stream`: an id its caller chose) counts until its caller says `stream_closed`: Serve calls
        a streaming request complete long before its last chunk. Serve's callbacks run on threads and loops
        of their own, so a request may be reported ended before it is reported routed: it is not counted."""
        with self.lock:
            key = request_id if stream is None else stream
            ended_first = self._forget_ended(key)
            if stream is not None and not self._forget_ended(request_id):
                self.stream_requests.add(request_id)               # Serve's "complete" for it is still to come
            if not ended_first:
                self.in_flight[replica] = self.in_flight.get(replica, 0) + 1
                (self.routed if stream is None else self.streams)[key] = replica
            outcome, chosen = self.decided.pop(request_id, ("miss", None))
            if route:
                self.decisions["busy" if outcome == "hit" and replica != chosen else outcome] += 1
        if route:
            self.table.insert(route, replica)

    def completed(self, request_id: str) -> None:
        """Serve's word that a request is done (for a stream: that it started)."""
        with self.lock:
            if request_id in self.stream_requests:
                self.stream_requests.discard(request_id)
            else:
                self._release(request_id, self.routed.pop(request_id, None))

    def stream_closed(self, stream: str) -> None:
        """The caller is done with a stream (its last chunk, an error, or a client that left)."""
        with self.lock:
            self._release(stream, self.streams.pop(stream, None))

    def _release(self, key: str, replica: str | None) -> None:
        """One request fewer on `replica`; with no replica yet, remember that `key` ended before it was routed."""
        if replica is not None:
            self.in_flight[replica] = max(0, self.in_flight.get(replica, 0) - 1)
            return
        self.ended[key] = None
        while len(self.ended) > MAX_PENDING:
            self.ended.popitem(last=False)

    def _forget_ended(self, key: str) -> bool:
        """Whether `key` had ended before it was routed (and forget it)."""
        if key not in self.ended:
            return False
        del self.ended[key]
        return True

    def set_replicas(self, replicas: list[str]) -> None:
        """The replicas Serve runs now; the caches of those gone went with them."""
        with self.lock:
            gone = set(self.replicas) - set(replicas)
            self.replicas = list(replicas)
            for replica in gone:
                self.in_flight.pop(replica, None)
        for replica in gone:
            self.table.remove_replica(replica)

    def loads(self, replicas: Iterable[str]) -> dict[str, int]:
        with self.lock:
            return {r: self.in_flight.get(r, 0) for r in replicas}

    def in_flight_now(self) -> dict[str, int]:
        """Requests in flight per replica as this process's routers count them (streams until closed)."""
        return self.loads(self.replicas)

    def snapshot(self) -> dict[str, int]:
        """Routing decisions so far: hit (sent where its prefix was), miss (no replica had it), busy (the
        replica that had it was too busy)."""
        with self.lock:
            return dict(self.decisions)


ROUTER_STATE = RouterState()


def shared_state() -> RouterState:
    """This process's one `RouterState`, from the imported module: Serve unpickles the router class by value,
    once per handle, and a copy's own module globals would give each router a state of its own."""
    return importlib.import_module("rasd.serve.router").ROUTER_STATE


def _router_base() -> type:
    """Serve's RequestRouter alone: its default matches a chosen replica to the request it was chosen for
    (the FIFO mixin would hand it to the oldest waiting request instead, whatever that one's prefix)."""
    from ray.serve.request_router import RequestRouter

    return RequestRouter


class PrefixAffinityRouter(_router_base()):  # type: ignore[misc]
    """Ray Serve request router: a request with a `route` keyword (its prompt's text) goes to the replica
    holding the longest prefix of it (`choose`), the others to the least loaded replica."""

    def initialize_state(self, imbalance: int = IMBALANCE, max_keys: int = MAX_KEYS,
                         block_chars: int = BLOCK_CHARS) -> None:
        shared_state().configure(imbalance, max_keys, block_chars)

    def update_replicas(self, replicas: list[Any]) -> None:
        super().update_replicas(replicas)
        shared_state().set_replicas([r.replica_id.unique_id for r in replicas])

    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None) -> list[list[Any]]:
        """Ranks of one replica each, best first: Serve takes the first that has room. One replica per rank,
        because within a rank Serve picks by its own queue-length cache, which counts a stream as done once
        it has started."""
        state = shared_state()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = state.loads(by_id)
        ranked = sorted(candidate_replicas, key=lambda r: (loads[r.replica_id.unique_id], random.random()))
        route = None if pending_request is None else pending_request.kwargs.get("route")
        chosen = state.decide(pending_request.metadata.internal_request_id, route, loads) if route else None
        first = [] if chosen is None else [by_id[chosen]]
        return [[r] for r in first + [r for r in ranked if r.replica_id.unique_id != chosen]]

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        kwargs = pending_request.kwargs
        shared_state().routed_to(pending_request.metadata.internal_request_id, replica_id.unique_id,
                                 kwargs.get("route"), kwargs.get("stream_id"))

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        shared_state().completed(internal_request_id)
