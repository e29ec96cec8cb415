"""The Ray Serve app: builder (`build_app`, also the `serve run serve_config.yaml` entry point) and the `rasd
serve` command, kept apart from the deployments and from their config (`serve.config.ServeConfig`) like
`ray.serve.llm`.

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
from pathlib import Path
from typing import Any

from ray import serve

from rasd.serve.config import ServeConfig
from rasd.serve.ingress import RasdIngress
from rasd.serve.loopback import is_single_machine, loopback_env, single_machine_ray
from rasd.serve.replica import RasdServer

APP_NAME = "rasd"


# ---------------------------------------------------------------------------------------------- builder


def router_config(options: dict[str, Any] | None = None) -> Any:
    """Serve's `request_router_config` for the model replicas: the prefix-aware router, with its options."""
    from ray.serve.config import RequestRouterConfig

    from rasd.serve.router import PrefixAffinityRouter

    return RequestRouterConfig(request_router_class=PrefixAffinityRouter, request_router_kwargs=dict(options or {}))


def build_app(config: ServeConfig | dict[str, Any] | None = None, replica_cpus: float | None = None) -> Any:
    """The Serve application for a config (`serve run serve_config.yaml` calls this with its `args` dict, which
    `ServeConfig.from_dict` checks and resolves; `rasd serve` passes the `ServeConfig` of its flags).

    `num_replicas` / `autoscaling_config` may also be set the Ray Serve way, per deployment (`RasdServer`) in
    serve_config.yaml's `deployments:`; `replica_cpus` overrides the CPUs each replica reserves.
    """
    if not isinstance(config, ServeConfig):
        config = ServeConfig.from_dict(config)
    # a replica gets as many CPUs as it runs threads (Ray would otherwise pin it to one, OMP_NUM_THREADS=1);
    # with a verifier actor the replica only serves HTTP, and the actor sets its torch threads itself
    cpus = replica_cpus if replica_cpus is not None else 0 if config.verifier_actor else config.threads
    options: dict[str, Any] = {"ray_actor_options": {"num_cpus": cpus},
                               "request_router_config": router_config(config.router)}
    if config.replicas > 1:      # else Serve's default, which serve_config.yaml may override
        options["num_replicas"] = config.replicas
    replicas = RasdServer.options(**options)
    return RasdIngress.bind(replicas.bind(config), config)


# ---------------------------------------------------------------------------------------------- CLI


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
    config = ServeConfig.from_args(args)      # checked before any Ray process starts
    _refuse_open(args.host, config.api_key, getattr(args, "insecure_no_key", False))
    ray_host = args.ray_host
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
    _warn_open(args.host, config.api_key)
    print(f"rasd is serving {config.model} at {url}  (OpenAI API under {url}/v1, docs at {url}/docs)", flush=True)
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


def _refuse_open(host: str, key: str | None, accepted: bool) -> None:
    """A one-line error, before any Ray process starts, for a keyless service listening beyond this machine,
    unless the operator said so (`--insecure-no-key`): such a service answers anyone who can reach it, questions
    and writes into the index alike."""
    from rasd.errors import CliError

    if key is None and host not in LOOPBACK_HOSTS and not accepted:
        raise CliError(f"--host {host} without an API key would let anyone who can reach it use the service and "
                       "write into its index; set --api-key or RASD_API_KEY, or pass --insecure-no-key")


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
