"""What a training job measures itself: per-rank step (or collective) times to the fail-slow analyzer.

    from fleetmend.jobs import report_step
    report_step(job="12345", rank=3, node="gpu017", step=120, seconds=0.842)

Standard library only (a training image need not install fleetmend's dependencies: copying this
one file is enough). `report_step` never blocks and never raises: records go into a bounded queue
that a daemon thread sends in batches, one NATS core `PUB` per job and node per batch, on
`fleet.<cluster>.job.<node token>.<job>` (captured by the `FLEET_JOBS` stream): the subject names the
sender, and a node's credentials allow only its own (`fleetmend.subjects.node_job_subject`). While NATS is away the thread
reconnects with a backoff and the oldest records are dropped once the queue is full (counted in
`JobReporter.dropped`); the job never notices.

Wire format (JSON, one message per job and node per batch): `{"v": 1, "cluster": C, "job": J,
"steps": [[rank, node, step, seconds, unix_time], ...]}`; every row of one message names the node of
its subject, under the node's real name (the analyzer refuses a message that speaks for another node
than its subject's, or for several, and drops rows of a node it has no perf samples from).

Configuration: arguments, else `FLEETMEND_NATS_URL` (`nats://[user:password@]host:port`; a token as
`nats://token@host:port`) and `FLEETMEND_CLUSTER`. NKey and TLS authentication need the nats-py
client: where NATS requires them, have the job write its timings through a site relay instead.
"""

from __future__ import annotations

import collections
import json
import os
import re
import socket
import threading
import time
from urllib.parse import unquote, urlparse

_TOKEN = re.compile(r"[^A-Za-z0-9_-]")
BATCH_S = 1.0
"""A batch goes out at least this often (seconds) while records wait."""
MAX_BATCH = 256
"""Records per message at most (~60 bytes each: far below NATS's 1 MiB max payload)."""
MAX_QUEUE = 20_000
"""Records held while NATS is away; the oldest go first beyond this."""
CONNECT_TIMEOUT_S = 2.0
BACKOFF_MAX_S = 60.0


def node_name(value: str) -> str:
    """The node name as it is (the analyzer checks it with `fleetmend.subjects.check_node_name`): it
    travels in the JSON body, never in a subject, so it is not re-encoded (`ip-10-0-1-3.ec2.internal`
    stays that, not a token that names no node). Raises ValueError for an empty or overlong name."""
    name = str(value).strip()
    if not name or len(name) > 253:
        raise ValueError(f"invalid node name {name[:40]!r}")
    return name


_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def node_token(node: str) -> str:
    """The node's subject token, the rule of `fleetmend.subjects.node_token` (copied: this module is
    standard library only): `[A-Za-z0-9_-]` stay, every other character becomes `=XX` per UTF-8 byte
    (`ip-10-0-1-3.ec2.internal` → `ip-10-0-1-3=2Eec2=2Einternal`)."""
    return "".join(ch if ch in _SAFE else "".join(f"={b:02X}" for b in ch.encode("utf-8")) for ch in node)


def token(value: str) -> str:
    """A subject token: characters outside `[A-Za-z0-9_-]` become '-' (Slurm `123_4` stays, `a.b` → `a-b`)."""
    return _TOKEN.sub("-", str(value))[:128] or "-"


class JobReporter:
    """Batches step times and sends them from a daemon thread. Thread-safe; never raises.

    Args:
        url: NATS URL (default `$FLEETMEND_NATS_URL`, else nats://127.0.0.1:4222).
        cluster: cluster name (default `$FLEETMEND_CLUSTER`, else "local").
        batch_s, max_batch, max_queue: see module constants.
    """

    def __init__(self, url: str | None = None, cluster: str | None = None, *, batch_s: float = BATCH_S,
                 max_batch: int = MAX_BATCH, max_queue: int = MAX_QUEUE) -> None:
        self.url = url or os.environ.get("FLEETMEND_NATS_URL", "nats://127.0.0.1:4222").split(",")[0]
        self.cluster = token(cluster or os.environ.get("FLEETMEND_CLUSTER", "local"))
        self.batch_s, self.max_batch = batch_s, max_batch
        self._q: collections.deque = collections.deque(maxlen=max_queue)
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._closed = False
        self._next_try = 0.0
        self._backoff = 1.0
        self.sent = 0
        self.dropped = 0
        self.errors = 0

    def report(self, job: str, rank: int, node: str, step: int, seconds: float, at: float | None = None) -> None:
        """Queue one record (returns at once); `at`: unix time the step ended (default now). Bad values
        are dropped and counted, never raised."""
        try:
            rec = (token(job), int(rank), node_name(node), int(step), float(seconds),
                   round(time.time() if at is None else float(at), 3))
        except (TypeError, ValueError):
            self.dropped += 1
            return
        with self._cv:
            if len(self._q) == self._q.maxlen:
                self.dropped += 1
            self._q.append(rec)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="fleetmend-jobs", daemon=True)
                self._thread.start()
            if len(self._q) >= self.max_batch:
                self._cv.notify()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until the queue is empty (sent) or `timeout_s` passes. Returns whether it emptied."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            self._cv.notify()
        while time.monotonic() < deadline:
            with self._cv:
                if not self._q:
                    return True
            time.sleep(0.02)
        return False

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (within `timeout_s`) and stop the thread."""
        self.flush(timeout_s)
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._disconnect()

    # ------------------------------------------------------------------ sending (the daemon thread)

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._q and not self._closed:
                    self._cv.wait(self.batch_s)
                if self._closed and not self._q:
                    return
                batch = [self._q.popleft() for _ in range(min(self.max_batch, len(self._q)))]
            if not batch:
                continue
            if not self._send(batch):
                with self._cv:  # put them back (oldest dropped if the queue filled meanwhile)
                    for rec in reversed(batch):
                        if len(self._q) == self._q.maxlen:
                            self.dropped += 1
                            break
                        self._q.appendleft(rec)
                time.sleep(min(1.0, self.batch_s))

    def _connect(self) -> socket.socket | None:
        now = time.monotonic()
        if now < self._next_try:
            return None
        u = urlparse(self.url)
        try:
            s = socket.create_connection((u.hostname or "127.0.0.1", u.port or 4222), timeout=CONNECT_TIMEOUT_S)
            s.settimeout(CONNECT_TIMEOUT_S)
            info = b""
            while not info.endswith(b"\r\n"):
                chunk = s.recv(4096)
                if not chunk:
                    raise OSError("connection closed before INFO")
                info += chunk
            opts: dict = {"verbose": False, "pedantic": False, "name": "fleetmend-jobs", "lang": "python-stdlib",
                          "version": "1", "protocol": 0}
            if u.username and u.password is not None:
                opts.update(user=unquote(u.username), **{"pass": unquote(u.password)})
            elif u.username:
                opts["auth_token"] = unquote(u.username)
            s.sendall(b"CONNECT " + json.dumps(opts).encode() + b"\r\nPING\r\n")
            reply = b""
            while b"\r\n" not in reply:
                chunk = s.recv(4096)
                if not chunk:
                    raise OSError("connection closed after CONNECT")
                reply += chunk
            if reply.startswith(b"-ERR"):
                raise OSError(reply.strip().decode(errors="replace"))
        except OSError:
            self.errors += 1
            self._next_try = now + self._backoff
            self._backoff = min(BACKOFF_MAX_S, self._backoff * 2)
            return None
        self._backoff = 1.0
        return s

    def _disconnect(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    def _send(self, batch: list[tuple]) -> bool:
        if self._sock is None:
            self._sock = self._connect()
            if self._sock is None:
                return False
        by_job: dict[tuple[str, str], list] = {}  # one message per job and node: it speaks for that node only
        for job, rank, node, step, seconds, at in batch:
            by_job.setdefault((job, node), []).append([rank, node, step, seconds, at])
        out = b""
        for (job, node), steps in by_job.items():
            payload = json.dumps({"v": 1, "cluster": self.cluster, "job": job, "steps": steps},
                                 separators=(",", ":")).encode()
            subject = f"fleet.{self.cluster}.job.{node_token(node)}.{job}"
            out += f"PUB {subject} {len(payload)}\r\n".encode() + payload + b"\r\n"
        try:
            self._sock.sendall(out + b"PING\r\n")
            self._drain_control()
        except OSError:
            self.errors += 1
            self._disconnect()
            return False
        self.sent += len(batch)
        return True

    def _drain_control(self) -> None:
        """Read what the server sent (PONG, PING, -ERR) without waiting; answer a PING."""
        assert self._sock is not None
        self._sock.setblocking(False)
        try:
            data = self._sock.recv(65536)
        except BlockingIOError:
            data = b""
        finally:
            self._sock.settimeout(CONNECT_TIMEOUT_S)
        if b"PING\r\n" in data.replace(b"PONG", b""):
            self._sock.sendall(b"PONG\r\n")
        if b"-ERR" in data:
            raise OSError(data.decode(errors="replace").strip())


_default: JobReporter | None = None
_lock = threading.Lock()


def report_step(job: str, rank: int, node: str, step: int, seconds: float) -> None:
    """Report one step's wall time (seconds) of `rank` on `node` in `job`. Never blocks or raises.

    Uses one process-wide `JobReporter` configured from the environment (see module docstring).
    """
    global _default
    if _default is None:
        with _lock:
            if _default is None:
                _default = JobReporter()
    _default.report(job, rank, node, step, seconds)
