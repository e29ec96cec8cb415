"""The service's settings, typed: `ServeConfig` has one field per setting, each with its description, its
default and its range stated once (as Ray Serve LLM's `LLMConfig`).

Two ways in, both checked by `validate()` before any Ray process starts: `ServeConfig.from_args` (the `rasd
serve` flags, which `serve.options` builds from these fields) and `ServeConfig.from_dict` (serve_config.yaml's
`args`, what `serve run` hands `build_app`). Both resolve the API key and the thread count here, once, in the
process that builds the app, so a key set in any way applies however the service starts. Light on purpose (no
Ray, no torch): the CLI imports it to build its parser.
"""

from __future__ import annotations

import os
import types
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from rasd.decoding.runtime.repetition import DEFAULT_WINDOW, check_window
from rasd.serve.auth import API_KEY_ENV, resolve_api_key
from rasd.serve.limits import Limits


class ConfigError(ValueError):
    """A bad setting, in one line that starts with the field's name (`field`)."""

    def __init__(self, name: str, message: str):
        super().__init__(f"{name} {message}")
        self.field = name


def setting(default: Any = MISSING, description: str = "", *, minimum: float | None = None, flag: bool = False,
            factory: Any = MISSING) -> Any:
    """A config field: `description` (also the flag's help), `minimum` (its range, checked by `validate`), and
    `flag` when `rasd serve` takes it as `--<name>` one-to-one."""
    metadata = {"description": description, "minimum": minimum, "flag": flag}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class RouterOptions:
    """The prefix router's options (`PrefixAffinityRouter.initialize_state`); unset ones keep its defaults."""

    imbalance: int | None = setting(None, "a replica holding the prefix is skipped with this many more requests "
                                          "in flight than the least busy one", minimum=0)
    max_keys: int | None = setting(None, "prefix keys remembered", minimum=1)
    block_chars: int | None = setting(None, "characters per hashed prompt block", minimum=1)


@dataclass
class ServeConfig:
    """Everything a replica needs; plain values, so that it travels through Ray and YAML unchanged."""

    model: str = setting("default", "target: HF hub id, local path or `default` (the embedded model)", flag=True)
    index: str | None = setting(None, "index folder, or `sample` for the bundled Python reference", flag=True)
    draft_model: str | None = setting(None, "small causal LM sharing the target's tokenizer, or `eesd` (the "
                                            "target's own early-exit self-draft)", flag=True)
    device: str = setting("cpu", "torch device of the model", flag=True)
    dtype: str = setting("auto", "dtype of the model: auto (the fastest dtype exact on this machine, measured "
                                 "once), float32, bfloat16, float16, int8 or int4 (CPU weight-only)", flag=True)
    graphs: bool = setting(True, "on CUDA, verify in static shapes captured as CUDA graphs (--no-graphs: eager "
                                 "forwards)")
    method: str = setting("pld", "default method of /v1/completions and chat", flag=True)
    docqa_method: str = setting("rasd", "default method of /v1/docqa", flag=True)
    max_batch: int = setting(8, "requests decoded together", minimum=1, flag=True)
    prefill_chunk: int = setting(0, "prefill a request that joins running ones this many prompt tokens per step "
                                    "(0: at once)", minimum=0, flag=True)
    prefix_cache_mb: int = setting(1024, "keep the K/V of prompt prefixes (system prompt, chat history) for later "
                                         "requests, up to this many MiB (0: off)", minimum=0, flag=True)
    warm_methods: bool = setting(True, "decode a few tokens of every method at start (`Service._warm_methods`)")
    history_mb: int = setting(64, "earlier answers kept per replica as a drafting source (`history`, "
                                  "SuffixDecoding); 0: off", minimum=0, flag=True)
    max_waiting: int = setting(16, "queued requests beyond the batch (then 429)", minimum=0, flag=True)
    max_ingest_waiting: int = setting(2, "ingests that may wait behind the one running, per replica (then 429 "
                                         "with Retry-After)", minimum=0, flag=True)
    ingest_job_bytes: int = setting(1_000_000, "an ingest with more text than this (UTF-8 bytes) answers 202 with "
                                               "a job to poll at once (`\"async\": true` asks for one at any "
                                               "size)", minimum=0, flag=True)
    max_tokens_limit: int = setting(1024, "the largest max_tokens a request may ask for", minimum=1, flag=True)
    max_prompt_tokens: int | None = setting(None, "default: the model's context minus room for one token",
                                            minimum=1)
    repetition_window: int = setting(DEFAULT_WINDOW, "tokens: an answer asking for the repetition stop (every "
                                                     "/v1/docqa answer unless it says no) ends once its newest this "
                                                     "many tokens repeat a span it already holds", flag=True)
    limits: dict[str, int] = setting(description="request size limits by `Limits` name, each a positive integer "
                                                 "(docs/serving.md)", factory=dict)
    retrieval_shards: int = setting(0, "serve the index from this many RetrievalShard actors (by segment; 0 = in "
                                       "the replica)", minimum=0, flag=True)
    draft_workers: int = setting(0, "run the `rasd` method's draft model in this many DraftWorker actors, named "
                                    "rasd-draft-<i> in Ray namespace `rasd` (0 = in the replica); a dead or slow "
                                    "worker means no draft, same tokens", minimum=0, flag=True)
    draft_worker_model: str | None = setting(None, "the draft workers' model (default: --draft-model, else "
                                                   "`eagle:<--model>`, the target's EAGLE head, when it has one, "
                                                   "else `eesd:<--model>`, the EESD self-draft, which needs `rasd "
                                                   "train eesd`)", flag=True)
    draft_worker_options: dict[str, Any] = setting(description="Ray actor options of each draft worker (num_cpus, "
                                                               "num_gpus, resources)", factory=dict)
    draft_timeout_s: float = setting(2.0, "a draft call slower than this counts as no draft", minimum=0)
    verifier_actor: bool = setting(False, "decode in a TargetVerifier actor apart from the HTTP replica "
                                          "(placement, clean 503 on its death)", flag=True)
    verifier_options: dict[str, Any] = setting(description="Ray options of the verifier actor (num_gpus, "
                                                           "resources)", factory=dict)
    verifier_timeout_s: float = setting(10.0, "the verifier actor is pinged every second; one that answers no ping "
                                              "for this long while Ray says it is alive (stopped, deadlocked) is "
                                              "hung: /healthz 503, its requests and new ones 503 until it answers "
                                              "again", minimum=0.1)
    verifier_step_timeout_s: float = setting(300.0, "the longest a request waits for its next block from a verifier "
                                                    "that answers pings (a queued request or the prefill of a full "
                                                    "context on a CPU included), then 503", minimum=0.1)
    api_key: str | None = setting(None, f"require `Authorization: Bearer KEY` (or set {API_KEY_ENV})", flag=True)
    allowed_hosts: list[str] = setting(description="without a key, the Host names answered besides 127.0.0.1, "
                                                   "localhost and ::1 (`*`: any); other names get 421, against "
                                                   "DNS rebinding", factory=list)
    threads: int | None = setting(None, "torch threads of the replica (default: the cores split between the "
                                        "replicas)", minimum=1, flag=True)
    replicas: int = setting(1, "model replicas behind the one endpoint; a chat's turns and repeated prompts are "
                               "routed to the replica that cached them (default threads: the cores split between "
                               "them)", minimum=1, flag=True)
    router: dict[str, Any] = setting(description="prefix router options (`RouterOptions`)", factory=dict)
    served_model_name: str | None = setting(None, "the model's name in the API (default: rasd-default for the "
                                                  "embedded model, else --model)")
    extra: dict[str, Any] = setting(description="free-form settings for experiments", factory=dict)

    @property
    def model_name(self) -> str:
        return self.served_model_name or ("rasd-" + self.model if self.model == "default" else self.model)

    # ------------------------------------------------------------------------------------------ ways in

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> ServeConfig:
        """serve_config.yaml's `args` (what `build_app` receives): checked, then resolved (the `RASD_API_KEY`
        of whoever builds the app applies, not only one the replica's own environment happens to hold)."""
        values = dict(values or {})
        unknown = sorted(set(values) - set(cls.names()))
        if unknown:
            raise ConfigError("serve config", f"has unknown keys: {', '.join(unknown)}")
        config = cls(**values)
        config.validate()
        return config.resolved()

    @classmethod
    def from_yaml(cls, path: str | Path, app: str = "rasd") -> ServeConfig:
        """The config of application `app` in a Serve config file (serve_config.yaml), as `serve run` builds it."""
        import yaml

        document = yaml.safe_load(Path(path).read_text()) or {}
        for application in document.get("applications") or []:
            if application.get("name") == app:
                return cls.from_dict(application.get("args"))
        raise ValueError(f"{path}: no application named {app!r}")

    @classmethod
    def from_args(cls, args: Any) -> ServeConfig:
        """The `rasd serve` flags (`serve.options` builds them from these fields, so each flag's dest is its
        field): checked, then resolved. `--api-key`, else `RASD_API_KEY` of this shell. Errors are one-line
        `CliError`s naming the flag."""
        from rasd.errors import CliError

        given = vars(args)
        values = {name: given[name] for name in cls.names() if name in given}   # --no-graphs has dest graphs
        values["limits"] = cli_limits(args.limit)
        hosts = list(getattr(args, "allowed_host", None) or [])
        values["allowed_hosts"] = hosts + bound_name(getattr(args, "host", ""))
        values.update(verifier_values(args.verifier_gpus, args.verifier_resources, values["verifier_actor"]))
        workers = parse_resources(args.draft_worker_resources, "--draft-worker-resources", '{"rasd_draft": 1}')
        values["draft_worker_options"] = {"resources": workers} if workers else {}
        index = values["index"]
        if index and index != "sample" and not os.path.isdir(index):
            raise CliError(f"index folder not found: {index}")
        try:
            config = cls(**values)
            config.validate()
        except ConfigError as exc:     # named as its flag: prefix_cache_mb -> prefix-cache-mb
            flag = exc.field.replace("_", "-") if exc.field in values else exc.field
            raise CliError(str(exc).replace(exc.field, flag, 1)) from exc
        except ValueError as exc:
            raise CliError(str(exc)) from exc
        if index == "sample":
            from rasd.apps.sample_corpus import ensure_sample_index

            config.index = str(ensure_sample_index(config.model))   # built here, once, not inside the replica
        try:
            return config.resolved()
        except ValueError as exc:      # the key: its message names --api-key / RASD_API_KEY itself
            raise CliError(str(exc)) from exc

    # ------------------------------------------------------------------------------------------ checks

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def validate(self) -> None:
        """A one-line ValueError naming the first field whose value has the wrong type or is out of range."""
        hints = get_type_hints(type(self))
        for spec in fields(self):
            value = getattr(self, spec.name)
            check_type(spec.name, value, hints[spec.name])
            check_minimum(spec, value)
        check_limits(self.limits)
        check_router(self.router)
        if not all(isinstance(h, str) and h.strip() for h in self.allowed_hosts):
            raise ConfigError("allowed_hosts", f"must be a list of host names (got {self.allowed_hosts!r})")
        gpus = self.verifier_options.get("num_gpus", 0)
        if not isinstance(gpus, int | float) or gpus < 0:
            raise ConfigError("verifier_options", f"num_gpus must be a number >= 0 (got {gpus!r})")
        try:
            check_window(self.repetition_window)
        except ValueError as exc:
            raise ConfigError("repetition_window", f"is {self.repetition_window!r}: {exc}") from exc
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ConfigError("dtype", f"must be auto or one of {', '.join(DTYPE_NAMES)} (got {self.dtype!r})")
        if self.draft_workers:
            from rasd.distributed.draft_worker import check_spec, worker_spec

            check_spec(worker_spec(self.draft_worker_model, self.draft_model, self.model))

    def resolved(self) -> ServeConfig:
        """The config a replica runs: the key in force (`resolve_api_key`: this one, else `RASD_API_KEY`) and
        the thread count filled in; done once, by whoever builds the app."""
        threads = self.threads if self.threads is not None else default_threads(self.replicas)
        return replace(self, api_key=resolve_api_key(self.api_key), threads=threads)


# `loading.DTYPES` and `WEIGHT_ONLY` (not imported here: they need torch)
DTYPE_NAMES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "int8", "int4")


def default_threads(replicas: int = 1) -> int:
    """The node's cores shared by its replicas: one replica decodes for everyone (batching), so it should
    use them all; several split them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, replicas))


def bound_name(host: str | None) -> list[str]:
    """The address `--host` binds, as a Host name to answer: one the operator chose (not a wildcard, not loopback,
    which is always answered)."""
    from rasd.serve.auth import LOOPBACK_NAMES

    return [] if not host or host in ("0.0.0.0", "::") or host in LOOPBACK_NAMES else [host.lower()]


def check_type(name: str, value: Any, hint: Any) -> None:
    """ValueError unless `value` is of the annotated type (None allowed for optional fields; an int is a float,
    a bool is not a number)."""
    if get_origin(hint) in (Union, types.UnionType):
        if value is None and type(None) in get_args(hint):
            return
        (hint,) = [arg for arg in get_args(hint) if arg is not type(None)]
    base = get_origin(hint) or hint
    accepted = (int, float) if base is float else (base,)
    if not isinstance(value, accepted) or (isinstance(value, bool) and base in (int, float)):
        raise ConfigError(name, f"must be {base.__name__} (got {value!r})")


def check_minimum(spec: Field, value: Any, name: str = "") -> None:
    low = spec.metadata.get("minimum")
    if low is not None and value is not None and value < low:
        raise ConfigError(name or spec.name, f"must be >= {low} (got {value})")


def check_limits(limits: dict[str, Any]) -> None:
    """ValueError for a limit name `Limits` does not have, or a value that is not a positive integer."""
    unknown = sorted(set(limits) - set(Limits.names()))
    if unknown:
        raise ConfigError("limits", f"has unknown names: {', '.join(unknown)} (known: {', '.join(Limits.names())})")
    for name, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"limits.{name}", f"must be a positive integer (got {value!r})")


def check_router(options: dict[str, Any]) -> None:
    """ValueError for router options `RouterOptions` does not have, or values out of their range."""
    known = [f.name for f in fields(RouterOptions)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError("router", f"has unknown options: {', '.join(unknown)} (known: {', '.join(known)})")
    parsed = RouterOptions(**options)
    for spec in fields(parsed):
        value = getattr(parsed, spec.name)
        check_type(f"router.{spec.name}", value, get_type_hints(RouterOptions)[spec.name])
        check_minimum(spec, value, f"router.{spec.name}")


def cli_limits(pairs: list[str] | None) -> dict[str, int]:
    """`--limit NAME=VALUE` (repeatable) as the `limits` mapping; a one-line error for a malformed pair."""
    from rasd.errors import CliError

    limits: dict[str, int] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        if not sep or not value.strip().isdigit():
            raise CliError(f"--limit takes NAME=INTEGER (got {pair!r}); names: {', '.join(Limits.names())}")
        limits[name.strip()] = int(value)
    return limits


def verifier_values(gpus: float | None, resources_json: str | None, actor: bool) -> dict[str, Any]:
    """`--verifier-actor`, `--verifier-gpus`, `--verifier-resources` as config fields (either of the last two
    implies the first)."""
    from rasd.errors import CliError

    resources = parse_resources(resources_json, "--verifier-resources", '{"rasd_verifier": 1}')
    options: dict[str, Any] = {}
    if gpus is not None:
        if gpus < 0:
            raise CliError("--verifier-gpus must be >= 0")
        options["num_gpus"] = gpus
    if resources:
        options["resources"] = resources
    return {"verifier_actor": bool(actor or options), "verifier_options": options}


def parse_resources(text: str | None, flag: str, example: str) -> dict[str, float] | None:
    """A JSON object of Ray custom resources from a CLI flag; a one-line CliError otherwise."""
    import json

    from rasd.errors import CliError

    if not text:
        return None
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"{flag} is not JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise CliError(f"{flag} must be a JSON object, e.g. '{example}'")
    return parsed
