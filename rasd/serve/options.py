"""`rasd serve` arguments, kept apart from `serve.app` so that other commands start without importing Ray; the
flags that configure the service are built from `ServeConfig`'s fields."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any, get_args, get_type_hints

from rasd.serve.config import ServeConfig
from rasd.serve.limits import Limits


def port_number(text: str) -> int:
    """A TCP port (1-65535), refused by argparse in one line before Ray starts (a bad one failed minutes later)."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1-65535)")
    return port


def register(subparsers: Any) -> Any:
    p = subparsers.add_parser("serve", help="serve the model (OpenAI-compatible API + document QA) with Ray Serve")
    add_config_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--insecure-no-key", action="store_true",
                   help="serve beyond loopback (--host) without an API key: anyone who can reach it can use the "
                        "service and write into its index (refused without this flag)")
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    p.add_argument("--ray-host", default="127.0.0.1",
                   help="address the Ray that `rasd serve` starts binds (default 127.0.0.1: this machine only; "
                        "a head other nodes join needs a reachable one, see docs/serving.md)")
    p.add_argument("--detach", action="store_true",
                   help="deploy on a local Ray cluster (started if needed) and return; `rasd serve --stop` ends it")
    p.add_argument("--stop", action="store_true",
                   help="stop the services recorded under $RASD_HOME/run (detached or in the foreground): drain, "
                        "Serve down, the Ray rasd started stopped (a joined Ray keeps running)")
    p.add_argument("--grace-s", type=float, default=30.0,
                   help="on SIGTERM/SIGINT (or --stop), how long running requests get to finish before they are "
                        "cut with an error (default 30)")
    p.set_defaults(func=_run)
    return p


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """The `ServeConfig` flags: `--<field>` for each field marked `flag`, its default, type and help taken from
    the field (stated once, there), then the flags that fill a field from another form (`ServeConfig.from_args`)."""
    hints = get_type_hints(ServeConfig)
    for spec in fields(ServeConfig):
        if not spec.metadata["flag"]:
            continue
        flag, help_text = "--" + spec.name.replace("_", "-"), spec.metadata["description"]
        kind = hints[spec.name]
        if kind is bool:
            p.add_argument(flag, action="store_true", help=help_text)
        else:
            base = next((t for t in get_args(kind) if t is not type(None)), kind)
            p.add_argument(flag, type=None if base is str else base, default=spec.default, help=help_text)
    p.add_argument("--no-graphs", dest="graphs", action="store_false",
                   help="on CUDA, run eager forwards instead of static shapes captured as CUDA graphs")
    p.add_argument("--allowed-host", action="append", metavar="NAME",
                   help="without a key, a Host name answered besides the loopback ones (repeatable; `*`: any)")
    p.add_argument("--limit", action="append", metavar="NAME=VALUE",
                   help="a request size limit, repeatable: " + ", ".join(Limits.names()) + " (docs/serving.md)")
    p.add_argument("--draft-worker-resources", default=None, metavar="JSON",
                   help='Ray custom resources each draft worker needs, e.g. \'{"rasd_draft": 1}\'')
    p.add_argument("--verifier-gpus", type=float, default=None, help="GPUs the verifier actor needs (implies "
                   "--verifier-actor)")
    p.add_argument("--verifier-resources", default=None, metavar="JSON",
                   help='Ray custom resources of the verifier actor, e.g. \'{"rasd_verifier": 1}\' (implies '
                        "--verifier-actor)")


def _run(args: Any) -> int:
    from rasd.serve.app import run_serve

    return run_serve(args)
