"""Prometheus metrics of the service, exported from `DecodeStats` (the stats stay a plain dataclass).

Names follow vLLM's speculative-decoding metrics (`spec_decode_num_drafts`, `..._num_draft_tokens`,
`..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`) under a `rasd:` prefix, plus accepted tokens
per draft source, request latency and the scheduler's running/waiting counts.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from rasd.decoding.runtime.stats import DecodeStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServiceMetrics:
    """One registry per replica, so several services in one process never collide."""

    def __init__(self, load: Callable[[], tuple[int, int]]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.num_drafts = Counter("rasd:spec_decode_num_drafts", "Verification steps that carried a draft", registry=r)
        self.num_draft_tokens = Counter("rasd:spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.num_accepted = Counter("rasd:spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.per_pos = Counter("rasd:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by depth",
                               ["position"], registry=r)
        self.by_source = Counter("rasd:spec_decode_num_accepted_tokens_by_source",
                                 "Accepted tokens by draft source (bonus = the target's own token)", ["source"],
                                 registry=r)
        self.steps = Counter("rasd:decode_steps", "Verification forwards per request, summed", registry=r)
        self.generation_tokens = Counter("rasd:generation_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("rasd:prompt_tokens", "Prompt tokens processed", registry=r)
        # vLLM's names: prompt tokens looked up in the prefix cache, and those found there
        self.prefix_queries = Counter("rasd:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("rasd:prefix_cache_hits", "Prompt tokens whose K/V came from the prefix cache",
                                   registry=r)
        self.requests = Counter("rasd:requests", "Finished requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.latency = Histogram("rasd:request_latency_seconds", "End-to-end request latency", ["endpoint"],
                                 buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160), registry=r)
        running = Gauge("rasd:num_requests_running", "Requests in the decoding batch", registry=r)
        waiting = Gauge("rasd:num_requests_waiting", "Requests queued for the batch", registry=r)
        running.set_function(lambda: load()[0])
        waiting.set_function(lambda: load()[1])

    def record(self, endpoint: str, stats: DecodeStats, latency_s: float) -> None:
        """Account one finished request."""
        self.num_drafts.inc(sum(1 for n in stats.tree_sizes if n > 0))
        self.num_draft_tokens.inc(stats.num_draft_tokens)
        self.num_accepted.inc(stats.num_accepted_tokens)
        for depth, count in enumerate(stats.accepted_per_position):
            self.per_pos.labels(position=str(depth)).inc(count)
        for source, count in stats.accepted_by_source.items():
            self.by_source.labels(source=source).inc(count)
        self.steps.inc(stats.steps)
        self.generation_tokens.inc(stats.new_tokens)
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.prefix_queries.inc(stats.prompt_tokens)
        self.prefix_hits.inc(stats.cached_prompt_tokens)
        self.requests.labels(endpoint=endpoint, outcome="ok").inc()
        self.latency.labels(endpoint=endpoint).observe(latency_s)

    def failed(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint=endpoint, outcome=outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def merge_metrics(texts: list[bytes]) -> bytes:
    """One exposition of several replicas' registries: every sample summed over replicas (all of ours are
    counters, gauges of request counts and histograms, so a sum is the service's value)."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, tuple[str, str]] = {}
    totals: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text.decode("utf-8")):
            if family.name.endswith("_created"):
                continue
            families.setdefault(family.name, (family.type, family.documentation))
            samples = totals.setdefault(family.name, {})
            for s in family.samples:
                if s.name.endswith("_created"):              # creation timestamps: not summable, left out
                    continue
                key = (s.name, tuple(sorted(s.labels.items())))
                samples[key] = samples.get(key, 0.0) + s.value
    lines = []
    for name, (kind, doc) in families.items():
        header = f"{name}_total" if kind == "counter" else name    # as prometheus_client writes counters
        lines += [f"# HELP {header} {_escape(doc)}", f"# TYPE {header} {kind}"]
        for (sample, labels), value in totals[name].items():
            lines.append(f"{sample}{_labels(labels)} {_number(value)}")
    return ("\n".join(lines) + "\n").encode() if lines else b""


def router_metrics(decisions: dict[str, int], in_flight: dict[str, int] | None = None) -> bytes:
    """The prefix-aware router's decisions (`serve.router`): hit / (hit + miss + busy) is its hit rate; and the
    requests it counts in flight per replica, the load it routes by."""
    name = "rasd:router_requests_total"
    lines = [f"# HELP {name} Requests routed by prompt prefix, by outcome: hit (sent to the replica holding its "
             "prefix), miss (no replica held it), busy (that replica was too busy)", f"# TYPE {name} counter"]
    lines += [f'{name}{{outcome="{outcome}"}} {_number(count)}' for outcome, count in decisions.items()]
    if in_flight is not None:
        gauge = "rasd:router_requests_in_flight"
        lines += [f"# HELP {gauge} Requests the router counts in flight per replica (a stream until it closes)",
                  f"# TYPE {gauge} gauge"]
        lines += [f'{gauge}{{replica="{_escape(r)}"}} {_number(n)}' for r, n in in_flight.items()]
    return ("\n".join(lines) + "\n").encode()


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels) + "}"


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return repr(float(value)) if value != int(value) or abs(value) >= 1e15 else f"{int(value)}.0"
