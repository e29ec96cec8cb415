"""The Ray Serve app: config (`ServeConfig`), builder (`build_app`, also the `serve run serve_config.yaml`
entry point) and the `rasd serve` command, kept apart from the deployments like `ray.serve.llm`.

The app is two deployments: the HTTP ingress (`serve.ingress.RasdIngress`, no model) and the model replicas
(`serve.replica.RasdServer`, `num_replicas` of them), joined by a deployment handle whose request router is
prefix-aware (`serve.router.PrefixAffinityRouter`).

`rasd serve` starts (or joins, with `--address`) Ray, deploys the app, prints the URL and stays in the
foreground until interrupted; `--detach` leaves it running on a local Ray cluster and returns (`rasd serve
--stop` shuts it down), which is what `make run` / `make stop` use.
"""


import os
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from ray import serve

from rasd.serve.auth import resolve_api_key
from rasd.serve.ingress import RasdIngress
from rasd.serve.limits import Limits
from rasd.serve.loopback import is_single_machine, loopback_env, single_machine_ray
from rasd.serve.replica import RasdServer
from rasd.serve.service import ServeConfig, default_threads

APP_NAME = "rasd"


# ---------------------------------------------------------------------------------------------- builder


# The smallest value each numeric limit may take (a replica given less would fail while starting).
CONFIG_MINIMUMS = {"replicas": 1, "max_batch": 1, "max_waiting": 0, "max_tokens_limit": 1, "prefill_chunk": 0,
                   "prefix_cache_mb": 0, "history_mb": 0, "retrieval_shards": 0, "draft_workers": 0}


def check_config(args: dict[str, Any]) -> None:
    """Raise ValueError for unknown keys or out-of-range limits, before any Ray process starts."""
    unknown = sorted(set(args) - {f.name for f in fields(ServeConfig)})
    if unknown:
        raise ValueError(f"unknown serve config keys: {', '.join(unknown)}")
    check_limits(args.get("limits") or {})
    check_router(args.get("router") or {})
    for key, low in CONFIG_MINIMUMS.items():
        if args.get(key) is not None and int(args[key]) < low:
            raise ValueError(f"{key} must be >= {low} (got {args[key]})")


def app_args(args: dict[str, Any] | None) -> dict[str, Any]:
    """The replica's config: checked, with the key resolved here (the `RASD_API_KEY` of whoever builds the
    app applies, not only one the replica's own environment happens to hold) and threads filled in."""
    args = dict(args or {})
    check_config(args)
    args["api_key"] = resolve_api_key(args.get("api_key"))
    if args.get("threads") is None:
        args["threads"] = default_threads(int(args.get("replicas") or 1))
    return args


def check_limits(limits: dict[str, Any]) -> None:
    """ValueError for a limit name `Limits` does not have, or a value that is not a positive integer."""
    if not isinstance(limits, dict):
        raise ValueError("limits must be a mapping of limit names to positive integers")
    unknown = sorted(set(limits) - set(Limits.names()))
    if unknown:
        raise ValueError(f"unknown limits: {', '.join(unknown)} (known: {', '.join(Limits.names())})")
    for name, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"limit {name} must be a positive integer (got {value!r})")


def router_config(options: dict[str, Any] | None = None) -> Any:
    """Serve's `request_router_config` for the model replicas: the prefix-aware router, with its options."""
    from ray.serve.config import RequestRouterConfig

    from rasd.serve.router import PrefixAffinityRouter

    return RequestRouterConfig(request_router_class=PrefixAffinityRouter, request_router_kwargs=dict(options or {}))


ROUTER_OPTIONS = ("imbalance", "max_keys", "block_chars")


def check_router(options: Any) -> None:
    """ValueError for router options `PrefixAffinityRouter.initialize_state` does not take."""
    if not isinstance(options, dict):
        raise ValueError("router must be a mapping of router options to integers")
    unknown = sorted(set(options) - set(ROUTER_OPTIONS))
    if unknown:
        raise ValueError(f"unknown router options: {', '.join(unknown)} (known: {', '.join(ROUTER_OPTIONS)})")
    for name, value in options.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "imbalance" else 1):
            raise ValueError(f"router option {name} must be a {'non-negative' if name == 'imbalance' else 'positive'}"
                             f" integer (got {value!r})")


def build_app(args: dict[str, Any] | None = None, replica_cpus: float | None = None) -> Any:
    """The Serve application for a config dict (`serve run serve_config.yaml` calls this with its `args`).

    `num_replicas` / `autoscaling_config` may also be set the Ray Serve way, per deployment (`RasdServer`) in
    serve_config.yaml's `deployments:`; `replica_cpus` overrides the CPUs each replica reserves.
    """
    args = app_args(args)
    threads = int(args["threads"])
    # a replica gets as many CPUs as it runs threads (Ray would otherwise pin it to one, OMP_NUM_THREADS=1);
    # with a verifier actor the replica only serves HTTP, and the actor sets its torch threads itself
    cpus = replica_cpus if replica_cpus is not None else 0 if args.get("verifier_actor") else threads
    options: dict[str, Any] = {"ray_actor_options": {"num_cpus": cpus},
                               "request_router_config": router_config(args.get("router"))}
    if int(args.get("replicas") or 1) > 1:      # else Serve's default, which serve_config.yaml may override
        options["num_replicas"] = int(args["replicas"])
    replicas = RasdServer.options(**options)
    return RasdIngress.bind(replicas.bind(args), args)


# ---------------------------------------------------------------------------------------------- CLI


def config_from_args(args: Any) -> dict[str, Any]:
    index = args.index
    if index == "sample":
        from rasd.apps.sample_corpus import ensure_sample_index

        index = str(ensure_sample_index(args.model))   # built here, once, not inside the replica
    return {"model": args.model, "index": index, "draft_model": args.draft_model, "device": args.device,
            "dtype": args.dtype, "graphs": not getattr(args, "no_graphs", False), "method": args.method,
            "docqa_method": args.docqa_method,
            "max_batch": args.max_batch, "prefill_chunk": getattr(args, "prefill_chunk", 0),
            "prefix_cache_mb": getattr(args, "prefix_cache_mb", ServeConfig.prefix_cache_mb),
            "history_mb": getattr(args, "history_mb", ServeConfig.history_mb),
            "max_waiting": args.max_waiting, "max_tokens_limit": args.max_tokens_limit,
            "api_key": _cli_api_key(args.api_key), "limits": _cli_limits(getattr(args, "limit", None)),
            "threads": args.threads or default_threads(getattr(args, "replicas", 1)),
            "replicas": getattr(args, "replicas", 1),
            "retrieval_shards": getattr(args, "retrieval_shards", 0), **draft_worker_config(args),
            **verifier_config(args)}


def _cli_api_key(flag: str | None) -> str | None:
    """`--api-key`, else `RASD_API_KEY` of this shell: resolved here and passed in the config, so the key
    applies even when the replica runs on a Ray started elsewhere, with another environment."""
    from rasd.errors import CliError

    try:
        return resolve_api_key(flag)
    except ValueError as exc:
        raise CliError(str(exc)) from exc


def _cli_limits(pairs: list[str] | None) -> dict[str, int]:
    """`--limit NAME=VALUE` (repeatable) as the `limits` mapping; a one-line error for a malformed pair."""
    from rasd.errors import CliError

    limits: dict[str, int] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        if not sep or not value.strip().isdigit():
            raise CliError(f"--limit takes NAME=INTEGER (got {pair!r}); names: {', '.join(Limits.names())}")
        limits[name.strip()] = int(value)
    return limits


def verifier_config(args: Any) -> dict[str, Any]:
    """`--verifier-actor`, `--verifier-gpus`, `--verifier-resources` as ServeConfig keys (either of the
    last two implies the first)."""
    resources = parse_resources(getattr(args, "verifier_resources", None), "--verifier-resources",
                                '{"rasd_verifier": 1}')
    gpus = getattr(args, "verifier_gpus", None)
    options: dict[str, Any] = {}
    if gpus is not None:
        from rasd.errors import CliError

        if gpus < 0:
            raise CliError("--verifier-gpus must be >= 0")
        options["num_gpus"] = gpus
    if resources:
        options["resources"] = resources
    return {"verifier_actor": bool(getattr(args, "verifier_actor", False) or options), "verifier_options": options}


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


def draft_worker_config(args: Any) -> dict[str, Any]:
    """The draft-worker keys of ServeConfig from `--draft-workers`, `--draft-worker-model/-resources`."""
    from rasd.errors import CliError

    workers = getattr(args, "draft_workers", 0) or 0
    if workers < 0:
        raise CliError("--draft-workers must be >= 0")
    worker_model = getattr(args, "draft_worker_model", None)
    if workers:
        from rasd.distributed.draft_worker import check_spec, worker_spec

        try:
            check_spec(worker_spec(worker_model, args.draft_model, args.model))
        except ValueError as exc:
            raise CliError(str(exc)) from exc
    config: dict[str, Any] = {"draft_workers": workers, "draft_worker_model": worker_model}
    parsed = parse_resources(getattr(args, "draft_worker_resources", None), "--draft-worker-resources",
                             '{"rasd_draft": 1}')
    if parsed:
        config["draft_worker_options"] = {"resources": parsed}
    return config


# Ray Serve's controller runs its control loop every 0.1 s by default: 3-4% of a core on an idle 2-core
# machine, taken from the decoding threads (whose OpenMP barriers then wait for the descheduled one). Measured
# here: the whole idle Ray + Serve background 5.3% -> 2.0% of the CPUs, 8 concurrent document-QA requests
# ≈ 4% faster. One second is ample for one app's health checks and restarts.
LOOPBACK = "127.0.0.1"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
QUIET_RAY_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1.0"}


def ray_env(ray_host: str | None = None, http_host: str = LOOPBACK, http_port: int = 8000) -> dict[str, str]:
    """The environment for a Ray this command starts: the quiet defaults, unless the user set them; with
    `ray_host` on loopback, the bind shim that keeps every port of that Ray there (`serve.loopback`), all
    but the HTTP port when the user asked the service itself to listen beyond this machine."""
    env = {**QUIET_RAY_ENV, **os.environ}
    if ray_host is not None and ray_host in LOOPBACK_HOSTS:
        env.update(loopback_env(None if http_host in LOOPBACK_HOSTS else http_port))
    return env


def run_serve(args: Any) -> int:
    import ray

    from rasd.errors import CliError

    if args.stop:
        return stop_detached()
    if args.index and args.index != "sample" and not os.path.isdir(args.index):
        raise CliError(f"index folder not found: {args.index}")
    config = config_from_args(args)
    try:
        check_config(config)
    except ValueError as exc:
        raise CliError(str(exc).replace("_", "-")) from exc
    ray_host = getattr(args, "ray_host", LOOPBACK)
    if args.detach and not args.address:
        ensure_local_cluster(ray_host, args.host, args.port)
        address: str | None = "auto"
    else:
        address = args.address
    if address is None:                      # ray.init starts the local Ray: it inherits this environment
        os.environ.update(ray_env(ray_host, args.host, args.port))
    if (address is None and ray_host in LOOPBACK_HOSTS) or (address == "auto" and is_single_machine()):
        single_machine_ray()                 # this driver's node address is 127.0.0.1, as the head's
    local = {"_node_ip_address": ray_host} if address is None else {}   # a Ray started here binds ray_host
    ray.init(address=address, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}, **local)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    except ray.exceptions.RayError as exc:
        # Seen when the machine is saturated: Serve's HTTP proxy misses its readiness checks and is killed.
        raise CliError(f"Ray Serve did not come up ({type(exc).__name__}); if the machine is busy, retry when "
                       f"it is not (logs: /tmp/ray/session_latest/logs/serve/); stop leftovers with "
                       f"`rasd serve --stop`") from exc
    url = f"http://{args.host}:{args.port}"
    _warn_open(args.host, config["api_key"])
    print(f"rasd is serving {config['model']} at {url}  (OpenAI API under {url}/v1, docs at {url}/docs)", flush=True)
    if args.detach:
        print("detached: stop it with `rasd serve --stop` (or `make stop`)", flush=True)
        return 0
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("\nshutting down", file=sys.stderr)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def _warn_open(host: str, key: str | None) -> None:
    """Say whether a key protects the service, and warn when it listens beyond this machine without one."""
    if key is not None:
        print("API key required on every route but /healthz and the web page's files", flush=True)
    elif host not in LOOPBACK_HOSTS:
        print(f"warning: listening on {host} with no API key: anyone who can reach it can use the service "
              f"(set --api-key or RASD_API_KEY)", file=sys.stderr, flush=True)


def _ray_cli() -> str:
    """The `ray` command of this environment (the venv may not be on PATH)."""
    local = Path(sys.executable).parent / "ray"
    return str(local) if local.exists() else "ray"




def head_start_args(ray_host: str = LOOPBACK) -> list[str]:
    """`ray start` arguments of the local head `rasd serve` starts: its servers (GCS, raylet, object manager,
    workers) bind `ray_host`, by default this machine only; no dashboard; token auth stays Ray's default."""
    return ["start", "--head", f"--node-ip-address={ray_host}", "--include-dashboard=false",
            "--disable-usage-stats"]


def ensure_local_cluster(ray_host: str = LOOPBACK, http_host: str = LOOPBACK, http_port: int = 8000) -> None:
    """Start a local head node that outlives this process (a detached service needs one)."""
    probe = subprocess.run([_ray_cli(), "status"], capture_output=True, text=True)
    if probe.returncode == 0:
        return
    started = subprocess.run([_ray_cli(), *head_start_args(ray_host)], capture_output=True, text=True,
                             env=ray_env(ray_host, http_host, http_port))
    if started.returncode != 0:
        from rasd.errors import CliError

        raise CliError(f"could not start a local Ray cluster: {started.stderr.strip().splitlines()[-1:]}")


STOP_TIMEOUT_S = 30.0   # how long `rasd serve --stop` waits for Serve to drain before stopping Ray anyway


def within(fn: Any, timeout_s: float) -> bool:
    """Run `fn` on a daemon thread; True when it returned (or raised) within `timeout_s`.

    Why: `serve.shutdown()` waits for every replica to drain, and a replica busy in a long ingest kept
    `rasd serve --stop` waiting for minutes. Past the bound the caller stops Ray, which ends the replicas.
    """
    import threading

    done = threading.Event()

    def run() -> None:
        try:
            fn()
        except Exception as exc:    # noqa: BLE001 - reported, and the caller stops Ray either way
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name="rasd-stop").start()
    return done.wait(timeout_s)


def stop_detached(timeout_s: float = STOP_TIMEOUT_S) -> int:
    import ray

    if is_single_machine():
        single_machine_ray()
    drained = True
    try:
        ray.init(address="auto", log_to_driver=False)
    except (ConnectionError, RuntimeError) as exc:
        print(f"no running service found ({exc})", file=sys.stderr)
    else:
        drained = within(serve.shutdown, timeout_s)
        if not drained:
            print(f"the service did not shut down within {timeout_s:.0f} s (a replica busy, e.g. ingesting); "
                  "stopping its Ray cluster", file=sys.stderr)
        within(ray.shutdown, 10.0)
    subprocess.run([_ray_cli(), "stop", *([] if drained else ["--force"])], capture_output=True, text=True)
    print("stopped")
    return 0
