"""Activities of the `Sweep` workflow: a node's benchmark through its agent, fail_slow for outliers."""

from __future__ import annotations

import hashlib

from nats.aio.client import Client as NATS
from temporalio import activity

from activities.diagnostics import ask_agent
from fleetmend import __version__, subjects
from fleetmend.diagnostics import BenchReport, BenchRequest
from fleetmend.events import Component, FaultEvent, Severity, Source, new_event_id
from fleetmend.messages import Activity
from fleetmend.messages.sweep import BenchActivityRequest, FailSlowRequest
from fleetmend.sweep import clip_report


class SweepActivities:
    """Takes a connected `nats.aio.client.Client` (diag requests, JetStream publish)."""

    def __init__(self, nc: NATS) -> None:
        self._nc = nc

    @activity.defn(name=Activity.BENCH_NODE)
    async def bench_node(self, req: BenchActivityRequest) -> BenchReport:
        """Ask the node's agent for a `BenchReport` (answered within `req.deadline_s`), bounded by
        `fleetmend.sweep.clip_report` before it enters the workflow's history (a node answering with
        13,000 metrics costs 128 and a note).

        Raises:
            ApplicationError(type="AgentUnreachable"): no agent or no answer in time (the sweep lists it).
        """
        body = BenchRequest(sweep_id=req.sweep_id, deadline_s=req.deadline_s,
                            host_seconds=req.host_seconds, builtin=req.builtin).model_dump_json().encode()
        rep = await ask_agent(self._nc, req.cluster, req.node, body, req.deadline_s + 5, BenchReport, "benchmark")
        metrics, skipped, noise = clip_report(rep.metrics, rep.skipped, rep.noise_pct)  # bounded before history
        return rep.model_copy(update={"metrics": metrics, "skipped": skipped, "noise_pct": noise})

    @activity.defn(name=Activity.OPEN_FAIL_SLOW)
    async def open_fail_slow(self, req: FailSlowRequest) -> list[str]:
        """Publish one fail_slow FaultEvent per finding on the node's fault subject (JetStream,
        Nats-Msg-Id derived from sweep and node, so a retried activity does not open it twice).
        Returns the nodes."""
        js = self._nc.jetstream(timeout=10.0)
        out = []
        for f in req.findings:
            suffix = hashlib.sha1(f"{req.sweep_id}/{f.node}".encode()).hexdigest()[:8]
            eid = new_event_id()[:16] + suffix
            msg = (f"fail-slow (sweep {req.sweep_id}): {f.metric} {f.value:.4g} vs the sweep's median {f.median:.4g} "
                   f"(ratio {f.ratio:.3f}, more than {req.outlier_pct:g} % worse) among {f.nodes} nodes")
            ev = FaultEvent(event_id=eid, cluster=req.cluster, node=f.node, component=Component.GPU
                            if f.metric.startswith("gpu") else Component.CPU, kind="fail_slow",
                            severity=Severity.DEGRADED, message=msg, raw=msg, source=Source.SWEEP,
                            agent_version=__version__,
                            attrs={"metric": f.metric, "value": f.value, "peer_median": f.median,
                                   "ratio": round(f.ratio, 4), "windows": 1, "group_size": f.nodes,
                                   "sweep_id": req.sweep_id})
            await js.publish(subjects.fault_subject(req.cluster, f.node), ev.to_json_bytes(),
                             headers={"Nats-Msg-Id": f"sweep-{req.sweep_id}-{f.node}"})
            out.append(f.node)
        return out
