# Two images from one build, by role (pyproject.toml's dependency sets; docs/install.md):
#
#   docker build --target agent         -t ghcr.io/fleetmend/fleetmend-agent:0.1.0 .
#   docker build --target control-plane -t ghcr.io/fleetmend/fleetmend:0.1.0 .
#
# agent          the node agent (DaemonSet, one per GPU node): the base set only, no Temporal, no
#                Kubernetes client, no server binaries. Runs as root (the chart's agent is privileged
#                for the GPU reset; /dev/kmsg needs CAP_SYSLOG).
# control-plane  router, worker, analyzer, `fleetmend temporal setup` and the operator's commands:
#                the control-plane set plus Debian's Slurm client (`scontrol`, for `scheduler: slurm`)
#                and munge (the Slurm authentication the client speaks). Runs as uid 10001.
#
# Neither image carries nats-server or temporal: `fleetmend dev up` (the `dev` set) is for a laptop.
# tests/test_packaging.py installs each set in a clean venv the way these stages do (CI has no
# Docker daemon); tests/test_dockerfile.py checks the stages against the chart and compose files.

ARG PYTHON=python:3.11-slim-bookworm

# ---- build: one wheel of fleetmend and wheels of every dependency of both roles
FROM ${PYTHON} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY fleetmend ./fleetmend
COPY agents ./agents
COPY workflows ./workflows
COPY activities ./activities
RUN pip wheel --no-cache-dir --wheel-dir /wheels '.[control-plane]'

# ---- agent: the lean set
FROM ${PYTHON} AS agent
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels fleetmend \
 && rm -rf /wheels \
 && python -m agents --help >/dev/null
# Prometheus /metrics of the agent (metrics.agent_port).
EXPOSE 9303
ENTRYPOINT ["fleetmend"]
CMD ["agent"]

# ---- control-plane: router, worker, analyzer, setup Job, CLI; scontrol for Slurm clusters
FROM ${PYTHON} AS control-plane
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurm-client munge \
 && rm -rf /var/lib/apt/lists/* \
 && useradd -r -u 10001 fleetmend
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels 'fleetmend[control-plane]' \
 && rm -rf /wheels \
 && fleetmend worker --help >/dev/null && test -x /usr/bin/scontrol
USER 10001
# Prometheus /metrics: router 9301, worker 9302, analyzer 9304 (see docker-compose.yml).
EXPOSE 9301 9302 9304
ENTRYPOINT ["fleetmend"]
