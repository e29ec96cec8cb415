"""The local Ray that `rasd serve` starts listens on loopback only. Checked on a real `ray start --head` built
from `head_start_args` and `ray_env`, by listing the listening sockets of every process of that Ray session.

Ray 2.60 alone does not: given `--node-ip-address=127.0.0.1`, gcs_server and raylet still listen on `::`, the
dashboard agent on 0.0.0.0 and the runtime-env agent on the host's address. `ray_env` preloads the bind shim
(`rasd/serve/loopback.c`), tested here on its own too: what it rewrites and what it leaves alone."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.helpers import free_ports, kill_session

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}   # the last: a dual-stack socket on IPv4 loopback


def session_listeners(sid: int) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every listening TCP socket of the processes in session `sid`."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "name"]):
        try:
            if os.getsid(proc.pid) != sid:
                continue
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    found.append((conn.laddr.ip, conn.laddr.port, proc.info["name"]))
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return found


BIND_PROBE = """
import socket, sys
out = []
for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "::"),
                     (socket.AF_INET6, "::1"), (socket.AF_INET, "127.0.0.2")):
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.bind((host, 0)); s.listen(); out.append(s.getsockname()[0])
    except OSError as exc:
        out.append(type(exc).__name__)
keep = socket.socket(); keep.bind(("0.0.0.0", int(sys.argv[1]))); out.append(keep.getsockname()[0])
print(" ".join(out))
"""


def test_the_bind_shim_keeps_listening_sockets_on_loopback(tmp_path: Path) -> None:
    """Wildcard and foreign addresses become loopback (a dual-stack `::` becomes IPv4-mapped 127.0.0.1, so
    IPv4 clients still connect); loopback addresses and the one kept port (the HTTP service when asked to
    listen beyond this machine) are left alone."""
    from rasd.serve.loopback import loopback_env

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    keep = free_ports(1)[0]
    env = {**os.environ, "RASD_HOME": str(tmp_path), **loopback_env(keep_port=keep)}
    assert env["LD_PRELOAD"].endswith(".so")
    done = subprocess.run([sys.executable, "-c", BIND_PROBE, str(keep)], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    v4_any, v4_foreign, v6_any, v6_loop, v4_loop2, kept = done.stdout.split()
    assert v4_any == v4_foreign == "127.0.0.1" and v6_any in ("::ffff:127.0.0.1", "::1")
    assert v6_loop == "::1" and v4_loop2 == "127.0.0.2" and kept == "0.0.0.0"


@pytest.mark.slow
def test_rasd_serve_ray_head_listens_on_loopback_only() -> None:
    pytest.importorskip("ray")
    pytest.importorskip("psutil")
    from rasd.serve.app import head_start_args, ray_env

    temp = Path(tempfile.mkdtemp(prefix="rl-", dir="/tmp"))   # short: Ray's socket paths have a length limit
    token = temp / "auth_token"
    token.write_text(secrets.token_hex(32))
    from rasd.serve.loopback import SINGLE_MACHINE_ENV

    env = {k: v for k, v in ray_env("127.0.0.1").items() if not k.startswith("RAY_") or k in SINGLE_MACHINE_ENV}
    env.update(RAY_AUTH_TOKEN_PATH=str(token), RAY_USAGE_STATS_ENABLED="0")
    assert "LD_PRELOAD" in env and env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    gcs, client, agent, agent_grpc, rt_env, metrics, objm, nodem = free_ports(8)
    args = head_start_args()
    assert "--node-ip-address=127.0.0.1" in args and "--include-dashboard=false" in args
    ray_cli = str(Path(sys.executable).parent / "ray")
    head = subprocess.Popen(
        [ray_cli, *args, "--block", f"--port={gcs}", f"--ray-client-server-port={client}",
         f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
         f"--runtime-env-agent-port={rt_env}", f"--metrics-export-port={metrics}", f"--object-manager-port={objm}",
         f"--node-manager-port={nodem}", f"--temp-dir={temp}", "--num-cpus=1"],
        env=env, stdout=open(temp / "head.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline, ports = time.time() + 90, set()
        while time.time() < deadline and not {gcs, nodem, objm} <= ports:   # GCS, raylet, object manager up
            assert head.poll() is None, (temp / "head.log").read_text()[-3000:]
            time.sleep(1)
            ports = {port for _, port, _ in session_listeners(head.pid)}
        time.sleep(3)                                    # the agents that start after the raylet, too
        listeners = session_listeners(head.pid)
        assert {gcs, nodem, objm} <= {port for _, port, _ in listeners}, listeners
        assert [entry for entry in listeners if entry[0] not in LOOPBACK] == []
    finally:
        kill_session(head.pid)
        head.wait(timeout=20)
        subprocess.run(["rm", "-rf", str(temp)], check=False)
