"""Scheduler adapters (drain/undrain a node) and their activities.

CONTRACT (used by workflows/remediation.py; implementation in progress):

    @dataclass DrainRequest:   cluster: str; node: str; reason: str; incident_id: str
    @dataclass DrainResult:    node: str; drained: bool; owned: bool; operator_drained: bool; state: str; detail: str
        - drained: the node is (now) drained or draining
        - owned: fleetmend set this drain (reason carries the prefix / KV entry is ours)
        - operator_drained: someone else had drained it first (we leave it and never undrain it)
    @dataclass UndrainRequest: cluster: str; node: str; incident_id: str
    @dataclass UndrainResult:  node: str; resumed: bool; state: str; detail: str
        - resumed False when the drain is not ours (operator) or the node was not drained

    class SchedulerAdapter(Protocol):
        name: str
        async def drain(self, node: str, reason: str, incident_id: str) -> DrainResult
        async def undrain(self, node: str, incident_id: str) -> UndrainResult
        async def state(self, node: str) -> str

    class SchedulerActivities:
        def __init__(self, scheduler: SchedulerAdapter)
        @activity.defn(name="drain_node")   async def drain_node(self, req: DrainRequest) -> DrainResult
        @activity.defn(name="undrain_node") async def undrain_node(self, req: UndrainRequest) -> UndrainResult
"""
