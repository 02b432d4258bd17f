"""The fault path is reserved (issue 27, point 6): one node, with its own credentials, floods the job and perf
subjects past the whole JetStream store, and the next fault events, its own and another node's, are still
accepted. Every stream and bucket fleetmend creates has a byte bound (`fleetmend.infra.jetstream`), which
JetStream reserves at creation, so the used storage can never reach the store's limit and the flood only
evicts the flooding streams' own oldest messages.

The server's store is 96 MiB and the streams are created with small bounds so the flood takes seconds."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
import nats.js.errors
import pytest

from fleetmend import subjects
from fleetmend.config import StreamSettings
from fleetmend.dev import servers
from fleetmend.infra import security
from fleetmend.infra.jetstream import (
    JOB_MAX_MSG_BYTES,
    ensure_deadletter_stream,
    ensure_fault_stream,
    ensure_perf_stream,
    kv_config,
)
from tests.test_security import CLUSTER, event, node_client

MiB = 1024 * 1024
STORE_BYTES = 96 * MiB


@pytest.fixture
def small_store(tmp_path: Path):
    """A secured nats-server (nodes n1, n2) whose JetStream file store is `STORE_BYTES`, with the fault,
    dead-letter, perf and job streams created by the admin with bounds that fit in it."""
    cs = security.generate(tmp_path / "creds", CLUSTER, ["n1", "n2"])
    conf = tmp_path / "nats.conf"
    conf.write_text(f"jetstream {{ max_file_store: {STORE_BYTES} }}\n" + security.server_conf(cs.accounts_conf))
    port = servers.free_port()
    proc = servers.start_nats(tmp_path / "js", port, config_file=conf)
    url = f"nats://127.0.0.1:{port}"

    async def setup() -> None:
        nc = await nats.connect(url, nkeys_seed=str(cs.seed_file("admin")))
        js = nc.jetstream()
        await ensure_fault_stream(js, StreamSettings(fault_max_bytes=24 * MiB, fault_max_msgs_per_node=1000,
                                                     deadletter_max_bytes=4 * MiB))
        await ensure_deadletter_stream(js, StreamSettings(deadletter_max_bytes=4 * MiB))
        await ensure_perf_stream(js, perf_max_bytes=16 * MiB, job_max_bytes=16 * MiB)
        await nc.close()

    asyncio.run(setup())
    yield url, cs
    proc.stop()


async def test_a_node_flooding_jobs_and_perf_cannot_refuse_fault_events(small_store) -> None:
    url, cs = small_store
    n1 = await node_client(url, cs, "n1")
    js = n1.jetstream(timeout=10.0)
    payload = b"x" * (JOB_MAX_MSG_BYTES - 1024)
    flooded = 0
    try:
        # 2 × the whole store: 1.5 × over many job ids (each its own subject), the rest on its perf subject
        for i in range(2 * STORE_BYTES // len(payload)):
            subject = (subjects.job_subject(CLUSTER, "n1", f"j{i % 400}") if i % 4 else
                       subjects.perf_subject(CLUSTER, "n1"))
            try:
                await js.publish(subject, payload)
            except nats.js.errors.APIError:  # a refused flood message: the flooder does not care
                continue
            flooded += len(payload)
        for node, client in (("n1", n1), ("n2", await node_client(url, cs, "n2"))):
            ack = await client.jetstream(timeout=10.0).publish(subjects.fault_subject(CLUSTER, node),
                                                               event(node).to_json_bytes())
            assert ack.stream == subjects.FAULT_STREAM and ack.seq, f"{node}'s fault event accepted"
            if client is not n1:
                await client.close()
    finally:
        await n1.close()
    admin = await nats.connect(url, nkeys_seed=str(cs.seed_file("admin")))
    try:
        ajs = admin.jetstream()
        for name in (subjects.JOB_STREAM, subjects.PERF_STREAM):
            info = await ajs.stream_info(name)
            assert 0 < info.state.bytes <= 16 * MiB, (name, info.state.bytes)
        assert flooded > STORE_BYTES
    finally:
        await admin.close()


def test_every_bucket_of_the_contract_is_bounded() -> None:
    for bucket in (subjects.LEASE_KV_BUCKET, subjects.PERMIT_KV_BUCKET, subjects.DRAIN_KV_BUCKET,
                   subjects.TICKET_KV_BUCKET, subjects.NOTIFY_KV_BUCKET, subjects.ANALYZER_KV_BUCKET,
                   subjects.FINGERPRINT_KV_BUCKET, subjects.DRIFT_ALLOW_KV_BUCKET, "someone_elses"):
        cfg = kv_config(bucket)
        assert cfg.max_bytes and cfg.max_bytes > 0 and cfg.max_value_size and cfg.history == 1, bucket
