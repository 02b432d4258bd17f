"""The node agent process: probes → bounded queue → publisher (JetStream or spool), heartbeats,
diagnostics responder — one `asyncio.TaskGroup`.

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
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import structlog

from agents.diag import DiagResponder
from agents.probes import Emit, Probe, build_perf_sampler, build_probes
from agents.publisher import Publisher
from agents.spool import Spool
from fleetmend import __version__
from fleetmend.config import AgentSettings, Settings
from fleetmend.events import utcnow
from fleetmend.subjects import heartbeat_subject

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


async def _supervise(probe: Probe, emit: Emit, status: dict[str, str], restart: bool, log: Any) -> None:
    """Run one probe; on failure record it for the heartbeat and (unless `restart` is False)
    restart it with a doubling backoff. A restarted kmsg probe resumes from its cursor, so a restart
    loses nothing unless the kernel ring buffer wrapped in the meantime."""
    delay = PROBE_RESTART_MIN_S
    while True:
        status[probe.name] = "ok"
        started = time.monotonic()
        try:
            await probe.run(emit)
            log.info("probe_finished", probe=probe.name)
            return
        except Exception as err:  # noqa: BLE001 - any probe bug is contained here and reported
            status[probe.name] = f"failed: {err}"[:300]
            log.error("probe_failed", probe=probe.name, error=repr(err), restart_in_s=delay if restart else None)
            if not restart:
                return
        if time.monotonic() - started > PROBE_RESTART_MAX_S:
            delay = PROBE_RESTART_MIN_S
        await asyncio.sleep(delay)
        delay = min(delay * 2, PROBE_RESTART_MAX_S)
        log.info("probe_restarted", probe=probe.name)


async def run_agent(settings: Settings, kmsg_file: Path | None = None, once: bool = False,
                    stop: asyncio.Event | None = None, *, probes: list[Probe] | None = None,
                    inject_file: Path | None = None, kmsg: bool = True, hardware: bool | None = None,
                    nvml: Any = "default",
                    shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S) -> int:
    """Run the node agent until `stop` is set (or, with `once`, until the probes are done).

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
    Returns:
        0; with `once`, 1 when events are left in the spool (NATS unreachable), after printing how
        many to stderr.
    """
    log = structlog.get_logger("fleetmend.agent").bind(cluster=settings.cluster, node=settings.node)
    state = agent_state_dir(settings)
    apply_process_limits(settings.agent, log)
    loop = asyncio.get_running_loop()
    own_signals = stop is None
    stop = stop or asyncio.Event()
    signals: list[int] = []
    if own_signals:
        hits = {"n": 0}

        def on_signal(signame: str) -> None:
            hits["n"] += 1
            if hits["n"] > 1 and signame == "SIGINT":
                log.warning("agent_forced_exit", signal=signame)
                os._exit(130)
            log.info("agent_stopping", signal=signame)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, on_signal, sig.name)
                signals.append(sig)

    spool = Spool(state / "spool", settings.agent.spool_max_bytes)
    publisher = Publisher(None, None, spool, settings.cluster, settings.node, settings.agent.publish_timeout_s)
    if probes is None:
        if hardware is None:
            hardware = not once and kmsg_file is None and inject_file is None
        probes = build_probes(settings, kmsg_file=kmsg_file, state_dir=state / "kmsg",
                              inject_file=inject_file, kmsg=kmsg, hardware=hardware, agent_state_dir=state)
    lastboot = any(p.name == "lastboot" for p in probes)  # live: boots and clean stops are recorded
    # -- metrics (fleetmend/infra/metrics.py): /metrics port, spool depth at scrape time
    from fleetmend.infra import metrics

    metrics.start_http_server(settings.metrics.agent_port, settings.metrics.host)
    metrics.watch_spool(settings.cluster, spool)
    status: dict[str, str] = {p.name: "starting" for p in probes}
    conn: dict[str, Any] = {}
    connected = asyncio.Event()
    log.info("agent_starting", agent_version=__version__, probes=[p.name for p in probes], once=once,
             state_dir=str(state), spool_depth=spool.depth, nats_url=settings.nats_url)

    async def online_services() -> None:
        from fleetmend.infra.connect import connect_nats
        from fleetmend.infra.jetstream import ensure_fault_stream

        last_err = {"at": 0.0}

        async def error_cb(err: Exception) -> None:
            if time.monotonic() - last_err["at"] > NATS_ERROR_LOG_EVERY_S:
                last_err["at"] = time.monotonic()
                log.warning("nats_unreachable", url=settings.nats_url, error=repr(err), spool_depth=spool.depth)

        async def disconnected_cb() -> None:
            publisher.on_disconnected()

        async def reconnected_cb() -> None:
            log.info("nats_reconnected", spool_depth=spool.depth)
            publisher.on_reconnected()

        extra: dict[str, Any] = {}
        if not settings.nats_inbox_prefix and (settings.nats_nkey_seed or settings.nats_creds):
            # node credentials allow replies only below the node's own prefix; a DaemonSet cannot spell
            # it per node in its manifest, so it is derived from cluster and node
            from fleetmend.subjects import inbox_prefix

            extra["inbox_prefix"] = inbox_prefix(settings.cluster, settings.node)
        nc = await connect_nats(settings, name=f"fleetmend-agent-{settings.node}", wait_forever=True,
                                error_cb=error_cb, disconnected_cb=disconnected_cb, reconnected_cb=reconnected_cb,
                                **extra)
        conn["nc"] = nc
        js = nc.jetstream(timeout=settings.agent.publish_timeout_s)
        if settings.agent.manage_stream:
            try:
                await ensure_fault_stream(js, settings, timeout_s=settings.agent.publish_timeout_s)
            except Exception as err:  # noqa: BLE001 - e.g. no permission: the router/operator owns the stream
                log.warning("fault_stream_not_ensured", error=repr(err))
            publisher.ensure_stream = lambda: ensure_fault_stream(js, settings,
                                                                  timeout_s=settings.agent.publish_timeout_s)
        publisher.attach(nc, js)
        log.info("nats_connected", url=settings.nats_url, spool_depth=spool.depth)
        diag = DiagResponder(nc, settings.cluster, settings.node, nvml=nvml,
                             expected_gpus=settings.agent.expected_gpus, kmsg_path=settings.agent.kmsg.path)
        from agents.bench import GpuTools
        from agents.recovery import RecoveryHandler  # recovery requests share the diag subject

        from agents.lastboot import record_reboot_ordered

        diag.recovery = RecoveryHandler(settings.cluster, settings.node, reboot_command=settings.policy.reboot_command,
                                        gpu_reset_command=settings.policy.gpu_reset_command,
                                        on_reboot=(lambda req: record_reboot_ordered(state, req.incident_id))
                                        if lastboot else None)
        diag.bench_command = settings.agent.bench_command  # `fleetmend sweep` (agents/bench.py)
        diag.gpu_tools = GpuTools(load_command=settings.agent.gpu_load_command,
                                  load_seconds=settings.agent.gpu_load_seconds,
                                  nvbandwidth_command=settings.agent.nvbandwidth_command,
                                  dcgm_command=settings.agent.sweep_dcgm_command)
        await diag.start()
        conn["diag"] = diag
        connected.set()
        subject = heartbeat_subject(settings.cluster, settings.node)
        while not stop.is_set():
            if nc.is_connected:
                hb = {"node": settings.node, "cluster": settings.cluster, "agent_version": __version__,
                      "at": utcnow().isoformat(), "probes": dict(status), "spool_depth": spool.depth,
                      "spool_dropped": spool.dropped_count, "faults_lost": publisher.lost_count,
                      "spool_error": spool.error}
                with contextlib.suppress(Exception):  # core NATS, fire and forget; next beat retries
                    await nc.publish(subject, orjson.dumps(hb))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(settings.agent.heartbeat_interval_s):
                    await stop.wait()

    rc = 0
    try:
        async with asyncio.TaskGroup() as tg:
            pub_task = tg.create_task(publisher.run(), name="publisher")
            replay_task = tg.create_task(publisher.replay(), name="replay")
            online_task = tg.create_task(online_services(), name="nats")
            if once:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(settings.nats_connect_timeout_s):
                        await connected.wait()
            emit = metrics.counting_emit(publisher.emit)  # metrics: events by source/kind/severity
            probe_tasks = [tg.create_task(_supervise(p, emit, status, not once, log), name=p.name)
                           for p in probes]
            perf_task = tg.create_task(_perf_loop(settings, conn, connected, stop, hardware_live=bool(
                hardware if hardware is not None else (not once and kmsg_file is None and inject_file is None)),
                nvml=nvml, log=log), name="perf")
            stop_task = tg.create_task(stop.wait(), name="stop")
            beat_task = tg.create_task(metrics.beat_forever(stop), name="liveness")  # /healthz
            metrics.HEALTH.set_ready()  # /readyz: probes run (events spool while NATS is away)
            if once:
                done_task = tg.create_task(_gather(probe_tasks), name="probes")
                await asyncio.wait([stop_task, done_task], return_when=asyncio.FIRST_COMPLETED)
            else:
                await stop_task

            # -- shutdown: stop intake → finish in-flight → drain → close
            for t in probe_tasks:
                t.cancel()
            try:
                async with asyncio.timeout(shutdown_timeout_s):
                    log.info("agent_flushing", queued=publisher.queue.qsize())
                    await publisher.flush()
                    if once and spool.depth and connected.is_set():
                        log.info("agent_waiting_for_replay", spool_depth=spool.depth)
                        await publisher.wait_spool_empty()
            except TimeoutError:
                log.warning("agent_shutdown_timeout", queued=publisher.queue.qsize(), spool_depth=spool.depth)
            metrics.HEALTH.set_ready(False, "stopping")
            for t in (pub_task, replay_task, online_task, stop_task, beat_task, perf_task):
                t.cancel()
            if once:
                done_task.cancel()
    finally:
        await _close(conn, shutdown_timeout_s, log)
        publisher.close()  # the spool I/O thread finishes its call; the spool is ours again
        # Anything still queued (shutdown timeout) goes to disk rather than being lost.
        while not publisher.queue.empty():
            ev, _fut = publisher.queue.get_nowait()
            try:
                spool.append(ev.to_json_bytes(), ev.severity, ev.event_id)
            except Exception as err:  # noqa: BLE001 - counted and logged; the agent is stopping anyway
                publisher.record_lost(ev.event_id, getattr(err, "reason", type(err).__name__), str(err), kind=ev.kind)
        spool.close()
        for sig in signals:
            loop.remove_signal_handler(sig)
    if lastboot:
        from agents.lastboot import record_clean_stop

        try:
            record_clean_stop(state, settings.agent.host_root)  # the next boot is not an unexpected one
        except OSError as err:
            log.warning("clean_stop_not_recorded", error=repr(err))
    left = spool.depth
    log.info("agent_stopped", published=publisher.published_count, spooled=publisher.spooled_count,
             replayed=publisher.replayed_count, lost=publisher.lost_count, spool_depth=left,
             spool_dropped=spool.dropped_count)
    if kmsg_file is not None and publisher.published_count + publisher.spooled_count == 0:
        print(f"fleetmend agent: no kernel-log fault found in {kmsg_file}; the replay reads kernel logs "
              "(dmesg, journald, /dev/kmsg records). For nvidia-smi, dcgmi or other tool output use "
              "`fleetmend explain`.", file=sys.stderr)
    if once and left:
        print(f"fleetmend agent: {left} event(s) could not be published and remain in the spool at "
              f"{spool.directory}; they are sent when the agent next runs with NATS reachable",
              file=sys.stderr)
        rc = 1
    return rc


async def _perf_loop(settings: Settings, conn: dict[str, Any], connected: asyncio.Event, stop: asyncio.Event, *,
                     hardware_live: bool, nvml: Any, log: Any) -> None:
    """Publish a `PerfSample` every `agent.perf.interval_s` on the node's perf subject (core NATS,
    fire and forget: a sample lost while NATS is away is replaced by the next one). Live agents only."""
    if not (settings.agent.perf.enabled and hardware_live):
        return
    from fleetmend.subjects import perf_subject

    await connected.wait()
    sampler = build_perf_sampler(settings, nvml)
    assert sampler is not None  # agent.perf.enabled, checked above
    subject = perf_subject(settings.cluster, settings.node)

    async def publish(sample: Any) -> None:
        nc = conn.get("nc")
        if nc is not None and nc.is_connected:
            await nc.publish(subject, sample.to_json_bytes())

    log.info("perf_sampling", subject=subject, interval_s=settings.agent.perf.interval_s)
    await sampler.run(publish, stop)


async def _gather(tasks: list[asyncio.Task[None]]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)


async def _close(conn: dict[str, Any], timeout_s: float, log: Any) -> None:
    """Stop the diag responder, then drain and close NATS (`close_nats`), within `timeout_s` in all."""
    from fleetmend.infra.connect import close_nats

    diag: DiagResponder | None = conn.get("diag")
    nc = conn.get("nc")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    if diag is not None:
        try:
            async with asyncio.timeout(timeout_s):
                await diag.stop()
        except Exception as err:  # noqa: BLE001 - best effort at exit; the spool holds what matters
            log.warning("diag_stop_failed", error=repr(err))
    if nc is not None:
        log.info("nats_draining")
        await close_nats(nc, max(0.1, deadline - loop.time()))
