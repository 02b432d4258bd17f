"""`Sweep`: one on-demand benchmark sweep (id `sweep/<cluster>/<id>`, visible in the Temporal UI).

Asks every node's agent at once for the same short benchmark (activity `bench_node`, one attempt:
a node that does not answer within the deadline is listed, never waited on or retried), compares the
numbers across nodes (`fleetmend.sweep.compare`, pure) and, with `act`, opens a fail_slow incident
for each outlier (activity `open_fail_slow`: a FaultEvent on the node's fault subject, so the normal
pipeline takes it). Returns the `SweepResult`, bounded in size (`fleetmend.sweep.clip_report` per
node, `clip_result` overall, each with a note). At most `MAX_PARALLEL_BENCH` benchmarks run at once.
Deterministic: the order of commands depends only on the input; results are gathered in the
nodes' order.
"""

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from fleetmend.diagnostics import BenchReport
    from fleetmend.messages import Activity, BenchActivityRequest, FailSlowRequest, SweepApi, SweepInput, SweepResult
    from fleetmend.sweep import clip_report, clip_result, compare, findings

MAX_PARALLEL_BENCH = 32
"""Benchmarks one sweep runs at once: a sweep of 150 silent nodes holds 32 of the worker's activity
slots for one deadline at a time, never all of them, so a drain is not delayed behind it."""
ONE_TRY = RetryPolicy(maximum_attempts=1)
PUBLISH_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=5)


@workflow.defn(name=SweepApi.WORKFLOW)
class Sweep:
    @workflow.run
    async def run(self, inp: SweepInput) -> SweepResult:
        slots = asyncio.Semaphore(MAX_PARALLEL_BENCH)

        async def bench(n: str) -> BenchReport:
            async with slots:  # a sweep holds at most MAX_PARALLEL_BENCH of the worker's activity slots
                return await workflow.execute_activity(
                    Activity.BENCH_NODE, BenchActivityRequest(cluster=inp.cluster, node=n, sweep_id=inp.sweep_id,
                                                              deadline_s=inp.deadline_s,
                                                              host_seconds=inp.host_seconds, builtin=inp.builtin),
                    result_type=BenchReport, start_to_close_timeout=timedelta(seconds=inp.deadline_s + 15),
                    retry_policy=ONE_TRY, summary=f"benchmark {n}")

        answers = await asyncio.gather(*(bench(n) for n in inp.nodes), return_exceptions=True)
        reports: dict[str, dict[str, float]] = {}
        skipped: dict[str, dict[str, str]] = {}
        noise: dict[str, dict[str, float]] = {}
        missing: dict[str, str] = {}
        for node, a in zip(inp.nodes, answers, strict=True):
            if isinstance(a, BenchReport):
                reports[node], skipped[node], noise[node] = clip_report(a.metrics, a.skipped, a.noise_pct)
            elif isinstance(a, ActivityError):
                missing[node] = str(a.cause.message if a.cause is not None and hasattr(a.cause, "message")
                                    else a)
            else:
                missing[node] = repr(a)
        res = compare(inp.cluster, inp.sweep_id, reports, inp.outlier_pct, skipped, missing, noise)
        found = findings(res)
        res = clip_result(res)
        if inp.act and found:
            res.incidents_opened = await workflow.execute_activity(
                Activity.OPEN_FAIL_SLOW, FailSlowRequest(cluster=inp.cluster, sweep_id=inp.sweep_id,
                                                         outlier_pct=inp.outlier_pct, findings=found),
                result_type=list[str], start_to_close_timeout=timedelta(seconds=60), retry_policy=PUBLISH_RETRY,
                summary=f"fail_slow for {len(found)} outlier(s)")
        return res
