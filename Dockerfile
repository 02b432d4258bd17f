# One image for every fleetmend process (agent, router, worker); the command picks the role.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY fleetmend ./fleetmend
COPY agents ./agents
COPY workflows ./workflows
COPY activities ./activities
RUN pip install --no-cache-dir . && useradd -r -u 10001 fleetmend
USER 10001
# Prometheus /metrics when enabled: router 9301, worker 9302, agent 9303 (see docker-compose.yml).
EXPOSE 9301 9302 9303
ENTRYPOINT ["fleetmend"]
