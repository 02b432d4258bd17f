"""Session fixtures: real nats-server and real Temporal dev server on free ports.

Never mocks: every test that touches NATS or Temporal talks to the real processes started here
(the same `fleetmend.dev.servers` code that `fleetmend dev up` uses).

Under pytest-xdist (`./scripts/test -n 2`, what `.ci/run` runs) each worker process starts its own servers;
the tests on the one host-wide Slurm/munge daemons run in one worker (`pytest_collection_modifyitems`).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any, Awaitable, Callable

import pytest
from hypothesis import HealthCheck, settings

from fleetmend.dev import servers

pytest_plugins = ["tests.fixtures_slurm"]

IN_CI = os.environ.get("CI") == "true"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the group into the node id
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist's `--dist loadgroup`, every test on the session Slurm cluster runs in one worker: the
    cluster's munged is host-wide (`/run/munge`), and a second worker's teardown would stop it under the
    first one's tests."""
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("slurm"))

# Property tests assert properties, not speed: on a loaded 2-core box one example can take longer
# than hypothesis's 200 ms default deadline (a hostlist property test failed that way once).
settings.register_profile("fleetmend", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("fleetmend")


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory):
    """A JetStream nats-server on a free port. Yields an object with `.url`, `.proc`, `.restart()`."""
    d = tmp_path_factory.mktemp("nats")
    for attempt in range(3):  # a free port can be taken by another xdist worker's server before ours binds it
        port = servers.free_port()
        try:
            proc = servers.start_nats(d / "js", port)
            break
        except servers.ServerStartError:
            if attempt == 2:
                raise

    class Handle:
        url = f"nats://127.0.0.1:{port}"
        store = d / "js"

        def __init__(self) -> None:
            self.proc = proc

        def stop(self) -> None:
            self.proc.stop()

        def kill(self) -> None:
            self.proc.kill()

        def start(self) -> None:
            self.proc = servers.start_nats(d / "js", port)

    h = Handle()
    yield h
    h.proc.stop()


@pytest.fixture(scope="session")
def temporal_server(tmp_path_factory: pytest.TempPathFactory):
    """A Temporal dev server (SQLite file, search attributes registered) on free ports."""
    d = tmp_path_factory.mktemp("temporal")
    for attempt in range(3):  # a free port can be taken by another xdist worker's server before ours binds it
        port, ui_port = servers.free_port(), servers.free_port()
        address = f"127.0.0.1:{port}"
        try:
            proc = servers.start_temporal(d / "temporal.db", port, ui_port, ui=False)
            asyncio.run(servers.wait_temporal_ready(address, proc=proc))
            break
        except servers.ServerStartError:
            if "proc" in locals():
                proc.stop()
            if attempt == 2:
                raise

    class Handle:
        pass

    h = Handle()
    h.address = address  # type: ignore[attr-defined]
    h.proc = proc  # type: ignore[attr-defined]
    h.db = d / "temporal.db"  # type: ignore[attr-defined]
    yield h
    proc.stop()


@pytest.fixture
async def nc(nats_server):
    import nats

    client = await nats.connect(nats_server.url)
    yield client
    await client.close()


@pytest.fixture
async def temporal_client(temporal_server):
    from temporalio.client import Client

    from fleetmend.infra.converter import data_converter

    return await Client.connect(temporal_server.address, data_converter=data_converter)


@pytest.fixture
def unique() -> str:
    """A short unique token for per-test streams, task queues and node names."""
    return uuid.uuid4().hex[:10]


async def assert_eventually(check: Callable[[], Awaitable[Any] | Any], timeout_s: float = 30.0,
                            interval_s: float = 0.1, what: str = "condition") -> Any:
    """Poll `check` until it returns a truthy value (or stops raising AssertionError)."""
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            r = check()
            if asyncio.iscoroutine(r):
                r = await r
            if r:
                return r
        except AssertionError as err:
            last = err
        await asyncio.sleep(interval_s)
    raise AssertionError(f"{what} not reached within {timeout_s}s" + (f": {last}" if last else ""))


async def wait_agents_answer(nc: Any, cluster: str, nodes: Any, timeout_s: float = 30.0,
                             what: str = "agents answer on their diag subjects") -> None:
    """Until every node's agent answers a request on its diag subject (`subjects.diag_subject`)."""
    from fleetmend import subjects

    async def all_listening() -> bool:
        for n in nodes:
            try:
                await nc.request(subjects.diag_subject(cluster, n), b"{}", timeout=2)
            except Exception:
                return False
        return True

    await assert_eventually(all_listening, timeout_s=timeout_s, what=what)
