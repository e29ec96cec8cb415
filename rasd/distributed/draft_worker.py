"""The draft model in `DraftWorker` Ray actors, behind the same duck-typed interface as `DraftModelProposer`.

Why actors: the draft model's forwards compete with the target's for the verifier's cores (or GPU). A
`DraftWorker` owns one draft model (a separate small LM, or the target's EESD self-draft) and the draft
state of many requests (their draft KV caches), so drafting can run on another process or node. On the
verifier's side `RemoteDraft` stands where `RasdProposer.draft` would hold a local `DraftModelProposer`:
`start`, `propose` and `root_probs` become actor calls. With cost sizing, each `propose` carries the
replica's `GrowRule` for the step (acceptance estimates and step times, a few KB), so a worker stops growing
its tree where the sizer would stop a local draft's (`CostAwareSizer.grow_pays`).

Failure policy (as for retrieval lookups in `retrieval.py`): a draft only proposes tokens that the target
verifies, so a draft that does not arrive in time is simply no draft. Every call waits at most `timeout_s`;
on a timeout or a dead actor `RemoteDraft` answers "no draft" (a root-only tree; no pruning probabilities),
counts the failure, and does not call that worker again for `backoff_s`, so a dead worker costs one timeout
per back-off, not one per step. Decoding goes on with the remaining sources (retrieval, recycling) and the
same tokens. Workers restart (`max_restarts=-1`) and lose their state; an unknown request id is re-created
on the fly, which is exact because a draft proposer re-syncs its cache to whatever context it is given.

Names: a `DraftPool` names its workers `rasd-draft-<i>` in the Ray namespace `rasd`, so an operator (or a
fault-injection script) can find one: `ray.get_actor("rasd-draft-0", namespace="rasd")`.
"""

from __future__ import annotations

import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from rasd.decoding.model.eagle_head import EagleHead, head_path, head_taps
from rasd.decoding.proposers.base import ProposerBase
from rasd.decoding.proposers.draft import DraftModelProposer
from rasd.decoding.proposers.eagle import EagleProposer
from rasd.decoding.sizing.grow import GrowRule
from rasd.decoding.step.sampling import GREEDY, SamplingParams
from rasd.decoding.step.tree import DraftTree
from rasd.decoding.step.verify import Verdict

EESD_PREFIX = "eesd:"       # spec "eesd:<target model>": the target's EESD self-draft
EAGLE_PREFIX = "eagle:"     # spec "eagle:<target model>": the target's EAGLE head (fed the target's features)
CALL_TIMEOUT_S = 2.0        # a draft later than this is worth less than the step it delays
BACKOFF_S = 1.0             # after a failure, skip the worker this long (one timeout per back-off, not per step)
NAMESPACE = "rasd"
NAME_PREFIX = "rasd-draft"
DRAFT_RESOURCE = "rasd_draft"   # custom resource for cluster nodes meant to host draft workers
MAX_REQUESTS = 256          # per-request states a worker keeps (least recently used evicted; re-created if needed)
START_TIMEOUT_S = 600.0     # loading a model on a busy node can take minutes

Features = list[tuple[int, torch.Tensor]] | tuple[()]   # (first position, features [n, H]) per target forward


def worker_spec(worker_model: str | None, draft_model: str | None, model: str) -> str:
    """What draft workers load: their own model (`eagle:<target>` for the target's EAGLE head), else the draft
    model (`eesd`: the target's self-draft), else what `rasd` drafts with in-process: the target's EAGLE head
    when it has one (trained or shipped), else its self-draft."""
    from rasd.decoding.model.loading import is_self_draft
    from rasd.decoding.proposers.registry import rasd_head_by_default

    if worker_model:
        return worker_model
    if draft_model:
        return f"{EESD_PREFIX}{model}" if is_self_draft(draft_model) else draft_model
    return f"{EAGLE_PREFIX}{model}" if rasd_head_by_default(model) else f"{EESD_PREFIX}{model}"


def eesd_target(spec: str) -> str | None:
    """The target model named by an `eesd:<target>` spec ("default" when empty); None for other specs."""
    return (spec[len(EESD_PREFIX):] or "default") if spec.startswith(EESD_PREFIX) else None


def eagle_target(spec: str) -> str | None:
    """The target model named by an `eagle:<target>` spec ("default" when empty); None for other specs."""
    return (spec[len(EAGLE_PREFIX):] or "default") if spec.startswith(EAGLE_PREFIX) else None


def load_draft_model(spec: str, device: str = "cpu", dtype: str = "float32", eesd: str | None = None
                     ) -> torch.nn.Module:
    """The draft LM for a spec: a hub id / local path, or `eesd:<target>` for the target's self-draft.

    The self-draft is built from the target's own first layers plus the trained exit layer (`eesd` path, else
    $RASD_HOME/eesd/<target>.safetensors), so the worker loads the target itself: its layers are shared, not
    copied, and only N + 1 of them ever run here. `eagle:<target>` is the target's EAGLE head (an `EagleHead`,
    not an LM): the worker loads the target for the embedding and LM head the head shares.
    """
    from rasd.decoding.model.loading import load_model

    head_target = eagle_target(spec)
    if head_target is not None:
        from rasd.decoding.model.eagle_head import load_head

        return load_head(load_model(head_target, device=device, dtype=dtype).model, None, head_target)
    target_name = eesd_target(spec)
    if target_name is not None:
        from rasd.decoding.proposers.early_exit import load_early_exit

        target = load_model(target_name, device=device, dtype=dtype)
        return load_early_exit(target.model, eesd, target_name)
    return load_model(spec, device=device, dtype=dtype).model


def spec_taps(spec: Any) -> tuple[int, ...]:
    """The target layers an EAGLE head spec reads beside the final features (its clients send them too)."""
    if isinstance(spec, EagleHead):
        return spec.taps
    return head_taps(head_path(eagle_target(spec) or "default"))


def check_spec(spec: str) -> None:
    """Fail before any actor starts when the spec is the EESD self-draft and its trained weights are missing
    (workers could only fail to load them, one restart after another)."""
    head_target = eagle_target(spec)
    if head_target is not None:
        if not head_path(head_target).exists():
            raise ValueError(f"draft workers for {spec!r} need an EAGLE head ({head_path(head_target)} is missing): "
                             f"run `rasd train eagle --model {head_target} --data builtin`")
        return
    target = eesd_target(spec)
    if target is None:
        return
    from rasd.decoding.proposers.early_exit import eesd_path

    if not eesd_path(target).exists():
        raise ValueError(f"draft workers without a draft model host the EESD self-draft, whose exit layer "
                         f"{eesd_path(target)} is missing: run `rasd train eesd --model {target} --data builtin`, "
                         f"or give a draft model (--draft-model / --draft-worker-model)")


def node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray): tests and /v1/info check placement with it."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


class DraftWorker:
    """One draft model and the draft state of many requests (a Ray actor; a plain class in tests).

    `spec` is a model spec (see `load_draft_model`) or an already-built module (tests; Ray pickles it).
    Every request gets its own `DraftModelProposer` (own KV cache) over the shared model; `draft_options`
    are its options (top_k, width, max_depth, ...). Calls carry the request id; an id the worker does not
    know (it restarted, or evicted the state) is re-created on the fly.
    """

    def __init__(self, spec: str | torch.nn.Module, device: str = "cpu", dtype: str = "float32",
                 draft_options: dict[str, Any] | None = None, eesd: str | None = None, threads: int | None = 1,
                 fast: bool = True, max_requests: int = MAX_REQUESTS):
        from rasd.decoding.model.kernels import install

        if threads:   # Ray sets OMP_NUM_THREADS=1 for actors without CPUs; say how many threads we want
            torch.set_num_threads(threads)
        model = spec if isinstance(spec, torch.nn.Module) else load_draft_model(spec, device, dtype, eesd)
        # the verifier's engine installs the same kernels on a local draft: identical draft logits
        self.model = install(model.eval()) if fast else model.eval()
        self.head = isinstance(self.model, EagleHead)   # its requests need the target's features (`propose`)
        self.fast = fast
        self.draft_options = dict(draft_options or {})
        self.max_requests = max_requests
        self.requests: OrderedDict[str, DraftModelProposer] = OrderedDict()
        self.recreated = 0      # requests re-created from an unknown id (after a restart or an eviction)

    def _new(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams) -> DraftModelProposer:
        kind = EagleProposer if self.head else DraftModelProposer
        proposer = kind(self.model, **self.draft_options)
        proposer.start(prompt_ids, sampling)
        self.requests[request_id] = proposer
        while len(self.requests) > self.max_requests:
            self.requests.popitem(last=False)
        return proposer

    def _proposer(self, request_id: str, sampling: SamplingParams | None) -> DraftModelProposer:
        proposer = self.requests.get(request_id)
        if proposer is None:
            self.recreated += 1
            return self._new(request_id, [], sampling or GREEDY)
        self.requests.move_to_end(request_id)
        return proposer

    def start(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams) -> None:
        self._new(request_id, list(prompt_ids), sampling)

    def propose(self, request_id: str, context: list[int], max_nodes: int,
                sampling: SamplingParams | None = None, features: Features = (),
                grow: GrowRule | None = None) -> DraftTree:
        """The request's draft tree; sampled nodes' q come back on the CPU (the caller moves them).

        `features`: the target's features of the positions committed since the last call, for a head.
        `grow`: the caller's cost sizer's rule for this step (whether one more draft layer pays); None: the
        tree grows while its candidates clear the probability floor."""
        from rasd.decoding.model.kernels import fast_kernels

        proposer = self._fed(request_id, sampling, features)
        proposer.grow_pays = grow
        with fast_kernels(self.fast):
            tree = proposer.propose(context, max_nodes)
        tree.q = {i: q.cpu() for i, q in tree.q.items()}
        return tree

    def root_probs(self, request_id: str, context: list[int], sampling: SamplingParams | None = None,
                   features: Features = ()) -> torch.Tensor | None:
        """Draft next-token probabilities [vocab] after `context` (RASD's pruning source), on the CPU."""
        from rasd.decoding.model.kernels import fast_kernels

        proposer = self._fed(request_id, sampling, features)
        with fast_kernels(self.fast):
            probs = proposer.root_probs(context)
        return None if probs is None else probs.cpu()

    def _fed(self, request_id: str, sampling: SamplingParams | None, features: Features) -> DraftModelProposer:
        """The request's proposer, given the target's features that came with the call (heads only)."""
        proposer = self._proposer(request_id, sampling)
        for start, hidden in features:
            if self.head:
                proposer.observe_hidden(start, hidden.to(proposer.device))
        return proposer

    def finish(self, request_id: str) -> bool:
        """Free the request's draft cache; False when the worker did not hold it."""
        return self.requests.pop(request_id, None) is not None

    def ping(self) -> dict[str, Any]:
        """Liveness plus where this worker runs (node, pid) and how many requests it holds."""
        return {"node_id": node_id(), "pid": os.getpid(), "requests": len(self.requests),
                "recreated": self.recreated}


@dataclass
class DraftHealth:
    """One worker as its clients see it: calls, failures (timeouts, dead actor) and the current back-off.

    Shared by every `RemoteDraft` of the worker, so one request's failure spares the others the timeout.
    """

    calls: int = 0
    failures: int = 0
    skipped: int = 0            # calls answered "no draft" without asking, during a back-off
    down_until: float = 0.0     # time.monotonic() before which the worker is not asked
    last_error: str | None = None

    def up(self, now: float) -> bool:
        return now >= self.down_until

    def failed(self, error: BaseException, until: float) -> None:
        self.failures += 1
        self.down_until = until
        self.last_error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RemoteDraft(ProposerBase):
    """A `DraftModelProposer` look-alike whose draft runs in a `DraftWorker` (see the module docstring).

    One per request: it holds the request id. `model` is None so the engine has no local module to touch.
    With `wants_hidden` (the worker hosts an EAGLE head) the target's features of newly committed positions
    are kept here and travel with the next call: a few KB per step, never the context's features again.
    """

    name = "draft"
    model = None

    def __init__(self, actor: Any, request_id: str | None = None, timeout_s: float = CALL_TIMEOUT_S,
                 backoff_s: float = BACKOFF_S, health: DraftHealth | None = None, device: str = "cpu",
                 clock: Callable[[], float] = time.monotonic, wants_hidden: bool = False,
                 feature_layers: tuple[int, ...] = ()):
        self.wants_hidden = wants_hidden
        self.feature_layers = tuple(feature_layers)   # the target layers the worker's head reads (EAGLE-3)
        self.pending: list[tuple[int, torch.Tensor]] = []   # features not yet sent to the worker
        self.actor = actor
        self.request_id = request_id or uuid.uuid4().hex
        self.timeout_s, self.backoff_s = timeout_s, backoff_s
        self.health = health or DraftHealth()
        self.device = torch.device(device)
        self.clock = clock
        self.sampling = GREEDY
        self.closed = False
        self.sizer: Any = None   # a cost sizer whose `grow_rule` travels with each propose (`use_sizer`)

    @property
    def stats(self) -> DraftHealth:
        return self.health

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        self.sampling, self.closed, self.pending = sampling, False, []
        self._call("start", list(prompt_ids), sampling)

    def observe_hidden(self, start: int, hidden: torch.Tensor) -> None:
        """Keep the target's features of positions start.. for the next call (`decoding.features`)."""
        self.pending.append((start, hidden.detach().float().cpu()))

    def _features(self) -> list[tuple[int, torch.Tensor]]:
        sent, self.pending = self.pending, []
        return sent

    def use_sizer(self, sizer: Any) -> None:
        """Let a cost sizer stop the worker's tree where another layer cannot pay, as it does a local draft's:
        its `GrowRule` for the step (estimates and step times, a few KB) goes with every `propose`."""
        self.sizer = sizer if hasattr(sizer, "grow_rule") else None

    def propose(self, context: list[int], max_nodes: int) -> DraftTree:
        """The worker's tree, or the root alone when the worker is down or late (no draft, same tokens)."""
        grow = self.sizer.grow_rule(len(context)) if self.sizer is not None and max_nodes > 0 else None
        tree = (self._call("propose", list(context), max_nodes, self.sampling, self._features(), grow)
                if max_nodes > 0 else None)
        if tree is None:
            return DraftTree.root_only(context[-1])
        if tree.q:
            tree.q = {i: q.to(self.device) for i, q in tree.q.items()}
        return tree

    def root_probs(self, context: list[int]) -> torch.Tensor | None:
        """Draft probabilities [vocab], or None when the worker is down (RASD then prunes by counts)."""
        probs = self._call("root_probs", list(context), self.sampling, self._features())
        return None if probs is None else probs.to(self.device)

    def observe(self, context: list[int], tree: DraftTree, verdict: Verdict, logits: torch.Tensor) -> None:
        """The worker's cache catches up in the next `propose`, as a local draft's does."""

    def finish(self) -> None:
        """The request ended: free its state on the worker, without waiting (never blocks an event loop)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.actor.finish.remote(self.request_id)
        except Exception:   # the worker may be gone; its state went with it
            pass

    def _call(self, method: str, *args: Any) -> Any:
        """`actor.method(request_id, *args)` within the timeout; None when closed, backing off or failed."""
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        if self.closed:
            return None
        if not self.health.up(self.clock()):
            self.health.skipped += 1
            return None
        self.health.calls += 1
        ref = None
        try:
            ref = getattr(self.actor, method).remote(self.request_id, *args)
            return ray.get(ref, timeout=self.timeout_s)
        except (GetTimeoutError, RayError) as exc:
            self.health.failed(exc, self.clock() + self.backoff_s)
            if ref is not None:
                _cancel(ref)
            return None


def _create(remote: Any, *args: Any, wait_s: float = 10.0) -> Any:
    """Start an actor; a name still held by a just-killed predecessor (Ray frees it asynchronously) is
    retried for `wait_s` before the error goes up."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return remote.remote(*args)
        except ValueError as exc:
            if "already taken" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _cancel(ref: Any) -> None:
    """Drop a late call from the worker's queue (one already running just finishes)."""
    import ray

    try:
        ray.cancel(ref)
    except Exception:   # cancelling is best effort
        pass


class DraftPool:
    """`num_workers` DraftWorker actors for one model spec, handing out `RemoteDraft`s round robin.

    `actor_options` are Ray actor options merged over the defaults: `num_cpus` 0 with torch threads set
    explicitly (`threads`, default: the actor's `num_cpus`, at least 1; so a small node whose CPUs the replica
    holds can still host them), restarts forever, no task retries (a late draft is dropped, not re-run).
    Route workers with e.g. `{"resources": {"rasd_draft": 1}}` or `{"num_gpus": 1}`. Workers are named
    `<name_prefix>-<i>` in `namespace` unless `named=False`.
    """

    def __init__(self, spec: str | torch.nn.Module, num_workers: int, actor_options: dict[str, Any] | None = None,
                 *, device: str = "cpu", dtype: str = "float32", draft_options: dict[str, Any] | None = None,
                 eesd: str | None = None, threads: int | None = None, timeout_s: float = CALL_TIMEOUT_S,
                 backoff_s: float = BACKOFF_S, name_prefix: str = NAME_PREFIX, namespace: str = NAMESPACE,
                 named: bool = True, start_timeout_s: float = START_TIMEOUT_S):
        import ray

        if num_workers < 1:
            raise ValueError("a draft pool needs at least one worker")
        self.spec_name = spec if isinstance(spec, str) else type(spec).__name__
        self.device, self.timeout_s, self.backoff_s = device, timeout_s, backoff_s
        self.namespace = namespace
        self.actor_options = {"num_cpus": 0, "max_restarts": -1, "max_task_retries": 0, **(actor_options or {})}
        threads = threads or max(1, int(self.actor_options["num_cpus"] or 0))
        self.names = [f"{name_prefix}-{i}" for i in range(num_workers)] if named else []
        # A module is large: Ray keeps it in the object store, and frees an implicit argument after the first
        # creation, so a restart would fail. The pool holds its own reference for the workers' lifetime.
        self._spec_ref = ray.put(spec) if isinstance(spec, torch.nn.Module) else None
        spec_arg = self._spec_ref if self._spec_ref is not None else spec
        remote = ray.remote(DraftWorker)
        self.actors: list[Any] = []
        for i in range(num_workers):
            options = dict(self.actor_options)
            if named:
                options.update(name=self.names[i], namespace=namespace)
            self.actors.append(_create(remote.options(**options), spec_arg, device, dtype, draft_options, eesd,
                                       threads))
        self.health = [DraftHealth() for _ in self.actors]
        self._next = 0
        # the workers host an EAGLE head: their clients forward the target's features
        self.wants_hidden = isinstance(spec, EagleHead) or (isinstance(spec, str) and eagle_target(spec) is not None)
        self.feature_layers = spec_taps(spec) if self.wants_hidden else ()
        self.wait_ready(start_timeout_s)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> list[dict[str, Any]]:
        """Every worker's `ping` (fails here, with the cause, rather than in the first request)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        try:
            return ray.get([a.ping.remote() for a in self.actors], timeout=timeout_s)
        except GetTimeoutError as exc:
            self.close()
            raise RuntimeError(f"draft workers for {self.spec_name!r} did not start within {timeout_s:.0f} s "
                               f"(is a node with {self.actor_options} free?)") from exc
        except RayError as exc:
            self.close()
            raise RuntimeError(f"draft workers for {self.spec_name!r} failed to start: "
                               f"{str(exc).strip().splitlines()[-1]}") from exc

    def remote_draft(self, request_id: str | None = None) -> RemoteDraft:
        """A client for the next worker in turn (one per request)."""
        i = self._next % len(self.actors)
        self._next += 1
        return RemoteDraft(self.actors[i], request_id, self.timeout_s, self.backoff_s, self.health[i], self.device,
                           wants_hidden=self.wants_hidden, feature_layers=self.feature_layers)

    def stats(self) -> dict[str, Any]:
        """What /v1/info reports: the workers, their names (for `ray.get_actor`) and failure counts."""
        totals = {k: sum(getattr(h, k) for h in self.health) for k in ("calls", "failures", "skipped")}
        workers = [{"name": self.names[i] if self.names else None, **h.to_dict()}
                   for i, h in enumerate(self.health)]
        return {"count": len(self.actors), "model": self.spec_name, "namespace": self.namespace,
                "names": list(self.names), **totals, "workers": workers}

    def close(self) -> None:
        import ray

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:   # already gone
                pass
        self.actors = []
