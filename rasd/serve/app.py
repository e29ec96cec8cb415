"""The Ray Serve app: builder (`build_app`, also the `serve run serve_config.yaml` entry point) and the `rasd
serve` command, kept apart from the deployments and from their config (`serve.config.ServeConfig`) like
`ray.serve.llm`.

The app is two deployments: the HTTP ingress (`serve.ingress.RasdIngress`, no model) and the model replicas
(`serve.replica.RasdServer`, `num_replicas` of them), joined by a deployment handle whose request router is
prefix-aware (`serve.router.PrefixAffinityRouter`).

`rasd serve` starts Ray in a session of its own (`serve.ray_head`), or joins one (`--address`, or one already
running here), deploys the app, prints the URL and stays in the foreground until SIGTERM/SIGINT, then drains and
stops what it started (`serve.lifecycle`); `--detach` records the service and returns (`rasd serve --stop`
stops it the same way), which is what `make run` / `make stop` use.
"""


import os
import sys
import time
from typing import Any

from ray import serve

from rasd.serve.config import ServeConfig
from rasd.serve.ingress import RasdIngress
from rasd.serve.lifecycle import (
    APP_NAME,
    DEFAULT_GRACE_S,
    ServiceRecord,
    StopRequested,
    StopSignals,
    drain_app,
    drain_summary,
    force_exit,
    remove_app,
    runs_dir,
    stop_head,
    stop_recorded,
)
from rasd.serve.loopback import loopback_env, single_machine_ray
from rasd.serve.ray_head import (
    RayHead,
    enable_default_token_auth,
    port_args,
    running_local_ray,
    session_pids,
    start_head,
)
from rasd.serve.replica import RasdServer

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
    """`rasd serve`: start (or join) Ray, deploy, and in the foreground serve until SIGTERM/SIGINT, then stop in
    order (`serve.lifecycle`); `--detach` returns with the service recorded for `--stop`."""
    from rasd.errors import CliError

    grace_s = getattr(args, "grace_s", DEFAULT_GRACE_S)
    if grace_s < 0:
        raise CliError(f"--grace-s must be >= 0 (got {grace_s:g})")
    if args.stop:
        return stop_recorded(grace_s)
    config = ServeConfig.from_args(args)      # checked before any Ray process starts
    _refuse_open(args.host, config.api_key, getattr(args, "insecure_no_key", False))
    run = Running()
    signals = StopSignals(force=lambda signum: force_exit(run.head, run.connected, signum))
    signals.install()                         # a signal while Ray starts stops what has started
    try:
        run.start(args, config)
        signals.install()                     # again: ray.init sets a SIGTERM handler of its own
        _announce(args, config)
        if args.detach:
            run.detached = True
            print("detached: stop it with `rasd serve --stop` (or `make stop`)", flush=True)
            return 0
        signals.serving = True
        while not signals.requested.wait(1.0):
            pass
        print(f"\nrasd: {signals.name()}: draining (running requests get up to {grace_s:g} s; a second signal "
              "stops at once)", file=sys.stderr, flush=True)
        summary = drain_summary(drain_app(grace_s), grace_s)
        print(f"rasd: stopped: {summary}; {run.stop()}", file=sys.stderr, flush=True)
        return 0
    except StopRequested as stop:
        print(f"\nrasd: {stop}: stopping during start-up; {run.stop()}", file=sys.stderr, flush=True)
        return 0
    finally:
        if not run.detached:
            run.stop()


class Running:
    """What one `rasd serve` has started, so that it is stopped once, in order, whatever ends the command."""

    def __init__(self) -> None:
        self.head: RayHead | None = None      # the Ray started here; None: a joined one (never stopped)
        self.connected = False
        self.detached = False
        self.record: ServiceRecord | None = None
        self.joined = ""
        self.done = ""

    def start(self, args: Any, config: ServeConfig) -> None:
        """Start or join Ray, deploy the app, record the service."""
        import ray

        from rasd.errors import CliError

        address, single = self._ray(args)
        local = {"_node_ip_address": args.ray_host} if self.head is not None and not single else {}
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}, **local)
        self.connected = True
        try:
            serve.start(http_options={"host": args.host, "port": args.port})
            serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        except ray.exceptions.RayError as exc:
            # Seen when the machine is saturated: Serve's HTTP proxy misses its readiness checks and is killed.
            raise CliError(f"Ray Serve did not come up ({type(exc).__name__}); if the machine is busy, retry when "
                           f"it is not (logs: {session_dir()}/logs/serve/)") from exc
        self.record = service_record(args, self.head, single, "detached" if args.detach else "foreground")
        self.record.save()

    def _ray(self, args: Any) -> tuple[str, bool]:
        """The Ray to deploy on, and whether it is single-machine: `--address`, else one already running here
        (both joined), else a head started now in its own session (owned)."""
        given = None if args.address in (None, "auto") else args.address
        found = given or running_local_ray()
        if found or args.address == "auto":
            self.joined = found or "auto"
            # a Ray on loopback runs in single-machine mode (as the one rasd starts): so must this driver
            single = self.joined.rpartition(":")[0].strip("[]") in LOOPBACK_HOSTS
            if single:
                single_machine_ray()
            # one found here is joined as `auto`, which turns token auth on as that Ray's `ray start` did
            return given or "auto", single
        single = args.ray_host in LOOPBACK_HOSTS
        enable_default_token_auth()           # before the head's environment is made: both use the same mode
        env = {**ray_env(args.ray_host, args.host, args.port), **OWN_HEAD_ENV}
        self.head = start_head([*head_start_args(args.ray_host), *port_args(single)], env,
                               runs_dir() / f"ray-head-{args.port}.log")
        if single:
            single_machine_ray()
        return self.head.address, single

    def stop(self) -> str:
        """Serve down (or rasd's app off a joined Ray), the Ray started here stopped, the record removed; once."""
        if self.done:
            return self.done
        if self.connected:
            remove_app(self.head is not None)
            self.connected = False
        done = stop_head(self.head) if self.head is not None else ""
        if self.record is not None:
            self.record.remove()
        self.done = done or (f"left the Ray at {self.joined} running (rasd joined it)" if self.joined
                             else "nothing had started")
        return self.done


OWN_HEAD_ENV = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}   # rasd drains first; Ray's own drain would wait


def session_dir() -> str:
    """The session folder of the Ray this driver joined ('' when unknown)."""
    import ray

    try:
        return str(ray._private.worker.global_worker.node.get_session_dir_path())
    except Exception:   # noqa: BLE001 - only used in messages and records
        return ""


def service_record(args: Any, head: RayHead | None, single: bool, mode: str) -> ServiceRecord:
    """The record `--stop` finds this service by (`serve.lifecycle.ServiceRecord`)."""
    import ray

    address = head.address if head is not None else ray.get_runtime_context().gcs_address
    return ServiceRecord(url=f"http://{args.host}:{args.port}", port=args.port, mode=mode, ray_address=address,
                         ray_owned=head is not None, pid=os.getpid(), ray_head_pid=head.pid if head else 0,
                         ray_session_dir=session_dir(), ray_auth_mode=os.environ.get("RAY_AUTH_MODE"),
                         single_machine=single, ray_pids=session_pids(head.pid) if head else [],
                         started=time.time())


def _announce(args: Any, config: ServeConfig) -> None:
    url = f"http://{args.host}:{args.port}"
    _warn_open(args.host, config.api_key)
    print(f"rasd is serving {config.model} at {url}  (OpenAI API under {url}/v1, docs at {url}/docs)", flush=True)


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


def head_start_args(ray_host: str = LOOPBACK) -> list[str]:
    """`ray start` arguments of the local head `rasd serve` starts: its servers (GCS, raylet, object manager,
    workers) bind `ray_host`, by default this machine only; no dashboard; token auth stays Ray's default."""
    return ["start", "--head", f"--node-ip-address={ray_host}", "--include-dashboard=false",
            "--disable-usage-stats"]
