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
