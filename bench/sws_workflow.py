"""A minimal workflow for the raw signal-with-start baseline: counts signals, never ends on its own."""

from __future__ import annotations

from temporalio import workflow


@workflow.defn(name="BenchSink")
class Sink:
    def __init__(self) -> None:
        self.n = 0

    @workflow.signal(name="ev")
    def ev(self, _i: int) -> None:
        self.n += 1

    @workflow.run
    async def run(self) -> int:
        await workflow.wait_condition(lambda: False)
        return self.n


@workflow.defn(name="BenchDrainOnce")
class DrainOnce:
    """The least Temporal work a drain can take: started by signal-with-start, one activity, done."""

    @workflow.signal(name="ev")
    def ev(self, _i: int) -> None:
        pass

    @workflow.run
    async def run(self) -> None:
        from datetime import timedelta

        await workflow.execute_activity("bench_drain", workflow.info().workflow_id,
                                        start_to_close_timeout=timedelta(seconds=30))
