"""Development only: `fleetmend dev up` (`devup`), the embedded nats-server and Temporal (`servers`),
and the simulators (`simulate`: a fleet of fake agents; `perfsim`: perf telemetry for fail-slow)."""
