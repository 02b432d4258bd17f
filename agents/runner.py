"""The node agent process: probes → bounded queue → publisher (JetStream or spool), heartbeats,
diagnostics responder — one `asyncio.TaskGroup`.

`Agent` is the process, in steps: `start()`, `run()`, `online()`, `shutdown()`, `close()`, `finish()`;
`run_agent(...)` runs one.

Start: apply `agent.cpu_affinity` / `agent.nice`, open the spool under
`<state_dir>/agent/<node>/spool`, start publisher and replay, connect to NATS in the background
(retrying forever: `max_reconnect_attempts=-1`; the spool takes events meanwhile), then ensure the
fault stream, answer diagnostics and send heartbeats.

Stop (SIGTERM/SIGINT set `stop`; a second SIGINT exits at once — everything accepted is already
fsync'd in the spool or acked by JetStream): stop intake (cancel probes) → flush the queue to
JetStream or the spool → stop the diag responder → `nc.drain()` → close, all within
`shutdown_timeout_s`, logging what it waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt, stop_never

from agents import metrics
from agents.lastboot import record_clean_stop, record_reboot_ordered
from agents.probes import Emit, Probe, build_perf_sampler, build_probes
from agents.publisher import Publisher
from agents.spool import Spool
from fleetmend import __version__
from fleetmend.config import AgentSettings, Settings
from fleetmend.events import utcnow
from fleetmend.infra.connect import close_nats, connect_nats
from fleetmend.infra.jetstream import ensure_fault_stream
from fleetmend.subjects import diag_subject, heartbeat_subject, inbox_prefix, perf_subject

if TYPE_CHECKING:
    from agents.diag import DiagResponder

SHUTDOWN_TIMEOUT_S = 10.0
"""Flush + drain budget at exit; systemd's default stop timeout is 90 s, Kubernetes' grace 30 s."""
PROBE_RESTART_MIN_S, PROBE_RESTART_MAX_S = 1.0, 300.0
"""A failing probe is restarted after 1 s, doubling to at most 5 min."""
NATS_ERROR_LOG_EVERY_S = 60.0


def agent_state_dir(settings: Settings) -> Path:
    """`<state_dir>/agent/<node>`: spool and kmsg cursor of this node's agent."""
    return settings.state_dir / "agent" / settings.node


def apply_process_limits(agent: AgentSettings, log: Any) -> dict[str, Any]:
    """Pin to `agent.cpu_affinity` and raise niceness to `agent.nice` (never lowers it).

    Returns what was applied, e.g. {"cpu_affinity": [0], "nice": 10}. Failures (no permission,
    CPU not present) are logged as `process_tuning_failed` and skipped, never fatal.
    """
    applied: dict[str, Any] = {}
    if agent.cpu_affinity:
        try:
            os.sched_setaffinity(0, set(agent.cpu_affinity))
            applied["cpu_affinity"] = sorted(os.sched_getaffinity(0))
        except (OSError, ValueError) as err:
            log.warning("process_tuning_failed", setting="agent.cpu_affinity", value=agent.cpu_affinity,
                        error=str(err))
    if agent.nice:
        try:
            current = os.getpriority(os.PRIO_PROCESS, 0)
            if current < agent.nice:
                os.setpriority(os.PRIO_PROCESS, 0, agent.nice)
            applied["nice"] = os.getpriority(os.PRIO_PROCESS, 0)
        except OSError as err:
            log.warning("process_tuning_failed", setting="agent.nice", value=agent.nice, error=str(err))
    log.info("process_tuned", **applied)
    return applied


class _RestartWait:
    """tenacity wait of a failed probe's restarts: 1 s doubling to 5 min, counted afresh after a run that
    lasted longer than 5 min (a probe failing once a day restarts after 1 s, not after 5 min)."""

    def __init__(self) -> None:
        self.first_failure = 1
        """Attempt number of the first failure of the current streak."""
        self.started = time.monotonic()

    def before(self, state: RetryCallState) -> None:
        self.started = time.monotonic()

    def __call__(self, state: RetryCallState) -> float:
        if time.monotonic() - self.started > PROBE_RESTART_MAX_S:
            self.first_failure = state.attempt_number
        doublings = min(state.attempt_number - self.first_failure, 30)  # a probe failing for weeks stays bounded
        return min(PROBE_RESTART_MIN_S * 2 ** doublings, PROBE_RESTART_MAX_S)


async def _supervise(probe: Probe, emit: Emit, status: dict[str, str], restart: bool, log: Any) -> None:
    """Run one probe; on failure record it for the heartbeat and (unless `restart` is False)
    restart it with a doubling backoff (tenacity, `_RestartWait`). A restarted kmsg probe resumes from its
    cursor, so a restart loses nothing unless the kernel ring buffer wrapped in the meantime."""
    wait = _RestartWait()

    async def run_once() -> None:
        status[probe.name] = "ok"
        try:
            await probe.run(emit)
        except Exception as err:
            status[probe.name] = f"failed: {err}"[:300]
            raise

    def before(state: RetryCallState) -> None:
        wait.before(state)
        if state.attempt_number > 1:
            log.info("probe_restarted", probe=probe.name)

    def failed(state: RetryCallState) -> None:
        err = state.outcome.exception() if state.outcome is not None else None
        log.error("probe_failed", probe=probe.name, error=repr(err),
                  restart_in_s=state.next_action.sleep if state.next_action is not None else None)

    retrying = AsyncRetrying(retry=retry_if_exception_type(Exception), wait=wait, before=before,
                             before_sleep=failed, stop=stop_never if restart else stop_after_attempt(1), reraise=True)
    try:
        await retrying(run_once)
    except Exception as err:  # noqa: BLE001 - any probe bug is contained here and reported
        log.error("probe_failed", probe=probe.name, error=repr(err), restart_in_s=None)  # restart=False: once
        return
    not_applicable = getattr(probe, "not_applicable", None)  # e.g. nvml on a host without NVIDIA GPUs
    if not_applicable:
        status[probe.name] = f"not applicable: {not_applicable}"
    log.info("probe_finished", probe=probe.name)


class DiagGate:
    """The node's diag subscription, light until a request comes: the first message builds the
    `DiagResponder` (`build(nc)`: agents.diag, agents.bench, agents.recovery and fleetmend.diagnostics
    imported then) and every message goes to it. A node never asked keeps them out of its memory."""

    def __init__(self, nc: Any, subject: str, build: Callable[[Any], DiagResponder], log: Any) -> None:
        self.nc, self.subject, self._build, self._log = nc, subject, build, log
        self.responder: DiagResponder | None = None
        self._sub: Any = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self.subject, cb=self._on_msg)
        self._log.info("diag_responder_started", subject=self.subject)

    async def _on_msg(self, msg: Any) -> None:
        if self.responder is None:
            self.responder = self._build(self.nc)
        await self.responder._on_msg(msg)

    async def stop(self) -> None:
        """Unsubscribe, then stop the responder's requests in progress."""
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except Exception as err:  # noqa: BLE001 - closing connection; nothing left to clean
                self._log.debug("diag_unsubscribe_failed", error=repr(err))
        if self.responder is not None:
            await self.responder.stop()


class Agent:
    """The node agent of one node (the shape of NPD's `ProblemDetector`): `start()` opens the spool
    and builds the probes, `run()` runs them, the publisher and `online()` in one `TaskGroup` until
    `stop` (or, with `once`, until the probes are done), then `shutdown()` and `close()`;
    `finish()` says how it went. `run_agent(...)` is the usual way in.

    Args:
        settings: cluster, node, NATS, `state_dir` and the `agent` section.
        kmsg_file: replay this captured kernel log (follow=False) through the same parser as
            the live `/dev/kmsg`, instead of following `agent.kmsg.path`.
        once: exit when every probe has finished and every event is acked by JetStream or spooled
            (and, if NATS is reachable, the spool replayed).
        stop: set it to shut down; None installs SIGTERM/SIGINT handlers that set one.
        probes: use these probes instead of `build_probes(...)` (tests, embedding).
        inject_file: also replay this JSON-lines file of events (`InjectProbe`).
        kmsg: False leaves the kmsg probe out.
        hardware: run the hardware probes (those whose `settings.agent.<probe>.enabled` is true); None (default):
            only when the agent runs live, i.e. without `once`, `kmsg_file` and `inject_file` (a replay
            or drill publishes exactly what it replays).
        nvml: `pynvml` module or stand-in for the diagnostics responder ("default": import it).
        shutdown_timeout_s: budget for flush + drain at exit.
    """

    def __init__(self, settings: Settings, kmsg_file: Path | None = None, once: bool = False,
                 stop: asyncio.Event | None = None, *, probes: list[Probe] | None = None,
                 inject_file: Path | None = None, kmsg: bool = True, hardware: bool | None = None,
                 nvml: Any = "default", shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        self.settings = settings
        self.kmsg_file, self.inject_file, self.kmsg = kmsg_file, inject_file, kmsg
        self.once = once
        self.own_signals = stop is None
        self.stop = stop or asyncio.Event()
        self.hardware = (not once and kmsg_file is None and inject_file is None) if hardware is None else hardware
        self.nvml = nvml
        self.shutdown_timeout_s = shutdown_timeout_s
        self.log = structlog.get_logger("fleetmend.agent").bind(cluster=settings.cluster, node=settings.node)
        self.state = agent_state_dir(settings)
        self.probes: list[Probe] = probes if probes is not None else []
        self._build_probes = probes is None
        self.lastboot = False
        """The lastboot probe runs (live): boots, ordered reboots and clean stops are recorded."""
        self.status: dict[str, str] = {}
        """probe name → "starting", "ok" or "failed: …", for the heartbeat."""
        self.connected = asyncio.Event()
        self.nc: Any = None
        self.diag: DiagGate | None = None
        self.signals: list[int] = []
        self.signal_count = 0
        self.nats_error_logged_at = 0.0
        self.probe_tasks: list[asyncio.Task[None]] = []
        self.service_tasks: list[asyncio.Task[Any]] = []
        """Cancelled after the flush, in this order: publisher, replay, nats, stop, liveness, perf."""

    def start(self) -> None:
        """Tune the process, take SIGTERM/SIGINT (unless given `stop`), open the spool and publisher,
        build the probes and serve /metrics."""
        settings = self.settings
        apply_process_limits(settings.agent, self.log)
        if self.own_signals:
            self._take_signals()
        self.spool = Spool(self.state / "spool", settings.agent.spool_max_bytes)
        self.publisher = Publisher(None, None, self.spool, settings.cluster, settings.node,
                                   settings.agent.publish_timeout_s)
        if self._build_probes:
            self.probes = build_probes(settings, kmsg_file=self.kmsg_file, state_dir=self.state / "kmsg",
                                       inject_file=self.inject_file, kmsg=self.kmsg, hardware=self.hardware,
                                       agent_state_dir=self.state)
        self.lastboot = any(p.name == "lastboot" for p in self.probes)
        metrics.serve(settings.metrics.agent_port, settings.metrics.host)  # 0: prometheus_client never imported
        metrics.watch_spool(settings.cluster, self.spool)
        self.status = {p.name: "starting" for p in self.probes}
        self.log.info("agent_starting", agent_version=__version__, probes=[p.name for p in self.probes],
                      once=self.once, state_dir=str(self.state), spool_depth=self.spool.depth,
                      nats_url=settings.nats_url)

    def _take_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_signal, sig.name)
                self.signals.append(sig)

    def _on_signal(self, signame: str) -> None:
        self.signal_count += 1
        if self.signal_count > 1 and signame == "SIGINT":
            self.log.warning("agent_forced_exit", signal=signame)
            os._exit(130)
        self.log.info("agent_stopping", signal=signame)
        self.stop.set()

    async def run(self) -> int:
        """`start()`, run until `stop` (or, with `once`, until the probes are done), shut down.

        Returns:
            `finish()`'s exit code.
        """
        self.start()
        try:
            async with asyncio.TaskGroup() as tg:
                pub_task = tg.create_task(self.publisher.run(), name="publisher")
                replay_task = tg.create_task(self.publisher.replay(), name="replay")
                online_task = tg.create_task(self.online(), name="nats")
                if self.once:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self.settings.nats_connect_timeout_s):
                            await self.connected.wait()
                emit = metrics.counting_emit(self.publisher.emit)  # metrics: events by source/kind/severity
                self.probe_tasks = [tg.create_task(_supervise(p, emit, self.status, not self.once, self.log),
                                                   name=p.name) for p in self.probes]
                perf_task = tg.create_task(self.perf(), name="perf")
                stop_task = tg.create_task(self.stop.wait(), name="stop")
                beat_task = tg.create_task(metrics.beat_forever(self.stop), name="liveness")  # /healthz
                self.service_tasks = [pub_task, replay_task, online_task, stop_task, beat_task, perf_task]
                metrics.set_ready()  # /readyz: probes run (events spool while NATS is away)
                if self.once:
                    done_task = tg.create_task(_gather(self.probe_tasks), name="probes")
                    self.service_tasks.append(done_task)
                    await asyncio.wait([stop_task, done_task], return_when=asyncio.FIRST_COMPLETED)
                else:
                    await stop_task
                await self.shutdown()
        finally:
            await self.close()
        return self.finish()

    async def online(self) -> None:
        """Connect to NATS (retrying forever; the spool takes events meanwhile), ensure the fault
        stream, hand the connection to the publisher, answer diagnostics, then send heartbeats
        until `stop`."""
        settings = self.settings
        extra: dict[str, Any] = {}
        if not settings.nats_inbox_prefix and (settings.nats_nkey_seed or settings.nats_creds):
            # node credentials allow replies only below the node's own prefix; a DaemonSet cannot spell
            # it per node in its manifest, so it is derived from cluster and node
            extra["inbox_prefix"] = inbox_prefix(settings.cluster, settings.node)
        nc = await connect_nats(settings, name=f"fleetmend-agent-{settings.node}", wait_forever=True,
                                error_cb=self._nats_error, disconnected_cb=self._nats_disconnected,
                                reconnected_cb=self._nats_reconnected, **extra)
        self.nc = nc
        js = nc.jetstream(timeout=settings.agent.publish_timeout_s)
        if settings.agent.manage_stream:
            try:
                await ensure_fault_stream(js, settings, timeout_s=settings.agent.publish_timeout_s)
            except Exception as err:  # noqa: BLE001 - e.g. no permission: the router/operator owns the stream
                self.log.warning("fault_stream_not_ensured", error=repr(err))
            self.publisher.ensure_stream = lambda: ensure_fault_stream(js, settings,
                                                                       timeout_s=settings.agent.publish_timeout_s)
        self.publisher.attach(nc, js)
        for probe in self.probes:  # the inventory probe keeps its own records (KV, stream) and answers live fixes
            if hasattr(probe, "attach"):
                await probe.attach(nc)
        self.log.info("nats_connected", url=settings.nats_url, spool_depth=self.spool.depth)
        await self._start_diag(nc)
        self.connected.set()
        await self._heartbeats(nc)

    async def _nats_error(self, err: Exception) -> None:
        if time.monotonic() - self.nats_error_logged_at > NATS_ERROR_LOG_EVERY_S:
            self.nats_error_logged_at = time.monotonic()
            self.log.warning("nats_unreachable", url=self.settings.nats_url, error=repr(err),
                             spool_depth=self.spool.depth)

    async def _nats_disconnected(self) -> None:
        self.publisher.on_disconnected()

    async def _nats_reconnected(self) -> None:
        self.log.info("nats_reconnected", spool_depth=self.spool.depth)
        self.publisher.on_reconnected()

    async def _start_diag(self, nc: Any) -> None:
        """Answer diagnostics, recovery requests (they share the diag subject) and `fleetmend sweep`
        benchmarks (agents/bench.py) on this node's diag subject: subscribed now, the responder built at
        the first request (`DiagGate`)."""
        diag = DiagGate(nc, diag_subject(self.settings.cluster, self.settings.node), self._build_diag,
                        structlog.get_logger("fleetmend.agent.diag").bind(cluster=self.settings.cluster,
                                                                        node=self.settings.node))
        await diag.start()
        self.diag = diag

    def _build_diag(self, nc: Any) -> DiagResponder:
        # lazy: the responder, its checks, the recovery handler, the sweep's benchmarks and the diagnostics
        # contract (~0.5 MiB) only on a node that is asked (DiagGate)
        from agents.bench import GpuTools
        from agents.diag import DiagResponder
        from agents.recovery import RecoveryHandler

        settings = self.settings
        diag = DiagResponder(nc, settings.cluster, settings.node, nvml=self.nvml,
                             expected_gpus=settings.agent.expected_gpus, kmsg_path=settings.agent.kmsg.path,
                             state_dir=self.state)
        on_reboot = self._record_reboot_ordered if self.lastboot else None
        diag.recovery = RecoveryHandler(settings.cluster, settings.node, reboot_command=settings.policy.reboot_command,
                                        gpu_reset_command=settings.policy.gpu_reset_command, on_reboot=on_reboot)
        diag.bench_command = settings.agent.bench_command
        diag.gpu_tools = GpuTools(load_command=settings.agent.gpu_load_command,
                                  load_seconds=settings.agent.gpu_load_seconds,
                                  nvbandwidth_command=settings.agent.nvbandwidth_command,
                                  dcgm_command=settings.agent.sweep_dcgm_command,
                                  bench_timeout_s=settings.agent.bench_timeout_s)
        return diag

    def _record_reboot_ordered(self, req: Any) -> None:
        record_reboot_ordered(self.state, req.incident_id)

    async def _heartbeats(self, nc: Any) -> None:
        """A heartbeat every `agent.heartbeat_interval_s` while connected (core NATS, fire and forget:
        the next beat retries), until `stop`. The last one, `leaving`, goes out in `_close_nats`."""
        while not self.stop.is_set():
            await self._beat(nc)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.agent.heartbeat_interval_s):
                    await self.stop.wait()

    async def _beat(self, nc: Any, leaving: bool = False) -> None:
        """One heartbeat. `leaving`: the agent stops on purpose (`--once` done, SIGTERM), so the router stops
        watching it instead of reporting it silent; an agent that dies (kill -9, OOM) sends none and is
        reported `agent_silent`."""
        if not nc.is_connected:
            return
        hb = {"node": self.settings.node, "cluster": self.settings.cluster, "agent_version": __version__,
              "at": utcnow().isoformat(), "probes": dict(self.status), "spool_depth": self.spool.depth,
              "spool_dropped": self.spool.dropped_count, "faults_lost": self.publisher.lost_count,
              "spool_error": self.spool.error, **({"leaving": True} if leaving else {})}
        with contextlib.suppress(Exception):
            await nc.publish(heartbeat_subject(self.settings.cluster, self.settings.node),
                             json.dumps(hb, separators=(",", ":")).encode())

    async def perf(self) -> None:
        """Publish a `PerfSample` every `agent.perf.interval_s` on the node's perf subject (core NATS,
        fire and forget: a sample lost while NATS is away is replaced by the next one). Live agents only."""
        settings = self.settings
        if not (settings.agent.perf.enabled and bool(self.hardware)):
            return
        await self.connected.wait()
        sampler = build_perf_sampler(settings, self.nvml)
        assert sampler is not None  # agent.perf.enabled, checked above
        subject = perf_subject(settings.cluster, settings.node)

        async def publish(sample: Any) -> None:
            if self.nc is not None and self.nc.is_connected:
                await self.nc.publish(subject, sample.to_json_bytes())

        self.log.info("perf_sampling", subject=subject, interval_s=settings.agent.perf.interval_s)
        await sampler.run(publish, self.stop)

    async def shutdown(self) -> None:
        """Stop intake (cancel the probes), flush the queue to JetStream or the spool (with `once`,
        also wait for the replay while connected), within `shutdown_timeout_s`; then cancel the rest."""
        for t in self.probe_tasks:
            t.cancel()
        publisher, spool = self.publisher, self.spool
        try:
            async with asyncio.timeout(self.shutdown_timeout_s):
                self.log.info("agent_flushing", queued=publisher.queue.qsize())
                await publisher.flush()
                if self.once and spool.depth and self.connected.is_set():
                    self.log.info("agent_waiting_for_replay", spool_depth=spool.depth)
                    await publisher.wait_spool_empty()
        except TimeoutError:
            self.log.warning("agent_shutdown_timeout", queued=publisher.queue.qsize(), spool_depth=spool.depth)
        metrics.set_ready(False, "stopping")
        for t in self.service_tasks:
            t.cancel()

    async def close(self) -> None:
        """Stop the diag responder, drain NATS, spool whatever is still queued, close the spool and
        give the signals back. Runs however `run()` ended."""
        await self._close_nats()
        self.publisher.close()  # the spool I/O thread finishes its call; the spool is ours again
        # Anything still queued (shutdown timeout) goes to disk rather than being lost.
        while not self.publisher.queue.empty():
            ev, _fut = self.publisher.queue.get_nowait()
            try:
                self.spool.append(ev.to_json_bytes(), ev.severity, ev.event_id)
            except Exception as err:  # noqa: BLE001 - counted and logged; the agent is stopping anyway
                self.publisher.record_lost(ev.event_id, getattr(err, "reason", type(err).__name__), str(err),
                                           kind=ev.kind)
        self.spool.close()
        loop = asyncio.get_running_loop()
        for sig in self.signals:
            loop.remove_signal_handler(sig)

    async def _close_nats(self) -> None:
        """Stop the diag responder, then drain and close NATS (`close_nats`), within
        `shutdown_timeout_s` in all."""
        timeout_s = self.shutdown_timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if self.diag is not None:
            try:
                async with asyncio.timeout(timeout_s):
                    await self.diag.stop()
            except Exception as err:  # noqa: BLE001 - best effort at exit; the spool holds what matters
                self.log.warning("diag_stop_failed", error=repr(err))
        if self.nc is not None:
            await self._beat(self.nc, leaving=True)  # drained with the rest below
            self.log.info("nats_draining")
            await close_nats(self.nc, max(0.1, deadline - loop.time()))

    def finish(self) -> int:
        """Record the clean stop (lastboot), log the totals, say on stderr what a replay found nothing
        in or left in the spool.

        Returns:
            0; with `once`, 1 when events are left in the spool (NATS unreachable).
        """
        if self.lastboot:
            try:
                record_clean_stop(self.state, self.settings.agent.host_root)  # the next boot is not an unexpected one
            except OSError as err:
                self.log.warning("clean_stop_not_recorded", error=repr(err))
        publisher, left = self.publisher, self.spool.depth
        self.log.info("agent_stopped", published=publisher.published_count, spooled=publisher.spooled_count,
                      replayed=publisher.replayed_count, lost=publisher.lost_count, spool_depth=left,
                      spool_dropped=self.spool.dropped_count)
        if self.kmsg_file is not None and publisher.published_count + publisher.spooled_count == 0:
            print(f"fleetmend agent: no kernel-log fault found in {self.kmsg_file}; the replay reads kernel logs "
                  "(dmesg, journald, /dev/kmsg records). For nvidia-smi, dcgmi or other tool output use "
                  "`fleetmend explain`.", file=sys.stderr)
        if self.once and left:
            print(f"fleetmend agent: {left} event(s) could not be published and remain in the spool at "
                  f"{self.spool.directory}; they are sent when the agent next runs with NATS reachable",
                  file=sys.stderr)
            return 1
        return 0


async def run_agent(settings: Settings, kmsg_file: Path | None = None, once: bool = False,
                    stop: asyncio.Event | None = None, *, probes: list[Probe] | None = None,
                    inject_file: Path | None = None, kmsg: bool = True, hardware: bool | None = None,
                    nvml: Any = "default",
                    shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S) -> int:
    """Run the node agent until `stop` is set (or, with `once`, until the probes are done); the
    arguments are `Agent`'s.

    Returns:
        0; with `once`, 1 when events are left in the spool (NATS unreachable), after printing how
        many to stderr.
    """
    return await Agent(settings, kmsg_file, once, stop, probes=probes, inject_file=inject_file, kmsg=kmsg,
                       hardware=hardware, nvml=nvml, shutdown_timeout_s=shutdown_timeout_s).run()


async def _gather(tasks: list[asyncio.Task[None]]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)
