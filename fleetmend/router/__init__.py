"""The router process: JetStream → validation, coalescing, the fast drain → Temporal signal-with-start.

- `fleetmend.router.core`: `Router`, the durable consumer and the routing;
- `fleetmend.router.heartbeats`: silent agents become `agent_silent` faults;
- `fleetmend.router.service`: `run_router`, the process.
"""

from fleetmend.router.service import run_router

__all__ = ["run_router"]
