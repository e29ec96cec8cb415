"""Loopback-only local Ray: what `rasd serve` does to the Ray it starts for itself.

Ray 2.60 on Linux turns `--node-ip-address=127.0.0.1` into the host's address ("remotely reachable"), binds
gcs_server and raylet on the wildcard address and its agents on 0.0.0.0 or the host's address
(tests/serve/test_ray_loopback.py lists them). A single-machine service needs none of them reachable from
outside, so two things:
- Ray's own single-machine mode (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, the default on Windows and macOS):
  the node's address is 127.0.0.1 and no other node may join. It is read when Ray is imported, so this
  process sets Ray's constant too (`single_machine_ray`).
- The bind() shim `loopback.c` in LD_PRELOAD of every Ray process: each listening socket binds loopback.
  Compiled once per machine with `cc` under $RASD_HOME/lib/; without a compiler `rasd serve` says so and
  starts Ray without it (Ray's token auth stays on either way).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from rasd.paths import rasd_home

SOURCE = Path(__file__).with_name("loopback.c")


def shim_path() -> Path:
    """Where the compiled shim for this source lives (its hash in the name: a changed source rebuilds)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    return rasd_home() / "lib" / f"rasd-loopback-{digest}.so"


def build_shim() -> Path | None:
    """The shim's path, compiled now if needed; None (with a one-line warning) without a working compiler."""
    target = shim_path()
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not sys.platform.startswith("linux"):
        _warn("no C compiler (cc) found" if compiler is None else f"not on Linux ({sys.platform})")
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    done = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(partial), str(SOURCE), "-ldl"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        _warn(f"compiling {SOURCE.name} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        return None
    os.replace(partial, target)          # atomic: a concurrent start sees the whole library or none
    return target


SINGLE_MACHINE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def single_machine_ray() -> None:
    """This process joins (or starts) a single-machine Ray: its node address is 127.0.0.1, as the head's."""
    from ray._private import ray_constants

    os.environ.update(SINGLE_MACHINE_ENV)
    ray_constants.ENABLE_RAY_CLUSTER = False


def loopback_env(keep_port: int | None = None) -> dict[str, str]:
    """Environment entries for a Ray whose processes must listen on loopback only: single-machine mode, and
    the bind shim when it could be built."""
    env = dict(SINGLE_MACHINE_ENV)
    shim = build_shim()
    if shim is None:
        return env
    env["LD_PRELOAD"] = " ".join(p for p in (str(shim), os.environ.get("LD_PRELOAD", "")) if p)
    if keep_port is not None:
        env["RASD_LOOPBACK_KEEP_PORT"] = str(keep_port)
    return env


def _warn(why: str) -> None:
    print(f"warning: {why}: the local Ray's own ports will listen on all interfaces (token auth stays on); "
          f"firewall them, see docs/serving.md", file=sys.stderr, flush=True)
