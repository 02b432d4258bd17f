"""The worker process: every workflow (`NodeRemediation`, `FleetGuard`, `Sweep`) and every activity
with its adapters, on the cluster's task queue and the guard's.

- `fleetmend.worker.build`: `build_worker` (the two Temporal workers, `Workers`), `workflow_runner`;
- `fleetmend.worker.service`: `run_worker`, the process (metrics, health, the elected replica's gauges);
- `fleetmend.worker.analyzer_link`: the fail-slow analyzer's domain findings to FleetGuard, the
  scheduler's running jobs to the analyzer.
"""

from fleetmend.worker.build import GRACEFUL_SHUTDOWN, Workers, build_worker, workflow_runner
from fleetmend.worker.service import run_worker

__all__ = ["GRACEFUL_SHUTDOWN", "Workers", "build_worker", "run_worker", "workflow_runner"]
