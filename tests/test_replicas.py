"""Streams and KV buckets at N replicas on a three-node JetStream cluster (issue 27, point 2a/2b).

`[streams] replicas` is the one setting for both: every stream and every KV bucket fleetmend creates takes it
(whoever creates it: router, worker activities, analyzer, ledger), a bucket that exists with another count is
left as it is and reported once (`bucket_settings_differ`), as streams are. The cluster is three real
`nats-server` processes from `fleetmend.dev.servers.start_nats_cluster`, and the client is given all three URLs.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import structlog

from activities.notify import Notifier
from activities.standalone import StandaloneScheduler
from activities.ticket_kv import KvTicketStore
from fleetmend import subjects
from fleetmend.analyzer.drift import DriftJudge, RepairWatch
from fleetmend.analyzer.service import analyzer_kv
from fleetmend.catalog import load_catalog
from fleetmend.config import load_settings
from fleetmend.dev import servers
from fleetmend.infra import jetstream
from fleetmend.infra.connect import close_nats, connect_nats
from fleetmend.infra.jetstream import (
    KV_MAX_BYTES,
    ensure_deadletter_stream,
    ensure_fault_stream,
    ensure_fingerprint_stores,
    ensure_perf_stream,
    open_kv_bucket,
    report_all_bucket_settings,
)
from fleetmend.infra.lease import lease_bucket
from fleetmend.infra.ledger import LedgerStore
from fleetmend.infra.permit_pool import PermitPool


@pytest.fixture
def cluster(tmp_path: Path):
    c = servers.start_nats_cluster(tmp_path / "nats")
    yield c
    c.stop()
    jetstream.use_replicas(1)  # connect_nats set this process's replicas: the next test's server has one node


def test_three_servers_form_one_jetstream_cluster(cluster: servers.NatsCluster) -> None:
    assert len({*cluster.ports, *cluster.cluster_ports, *cluster.http_ports}) == 9
    assert cluster.url == ",".join(f"nats://127.0.0.1:{p}" for p in cluster.ports)
    leaders = set()
    for i in range(3):
        assert cluster.monitor(i, "routez")["num_routes"] >= 2
        js = cluster.monitor(i, "jsz")
        assert js["meta_cluster"]["cluster_size"] == 3
        leaders.add(js["meta_cluster"]["leader"])
        assert cluster.servers[i].argv[-2:] == ["-c", str(cluster.dirs[i].parent / f"nats-{i}.conf")]
    assert len(leaders) == 1 and leaders <= {f"fleetmend-{i}" for i in range(3)}  # one meta leader, agreed on


async def test_every_stream_and_bucket_takes_the_configured_replicas(cluster: servers.NatsCluster,
                                                                      tmp_path: Path) -> None:
    s = load_settings(None, nats_url=cluster.url, cluster="east", state_dir=tmp_path, streams={"replicas": 3})
    nc = await connect_nats(s, name="replicas")  # every URL of the cluster, comma-separated
    try:
        js = nc.jetstream(timeout=10.0)
        # each creator as the processes call it
        await ensure_fault_stream(js, s)
        await ensure_deadletter_stream(js, s)
        await ensure_perf_stream(js)
        await ensure_fingerprint_stores(js)
        await PermitPool.open(js)
        await lease_bucket(js)
        await (await KvTicketStore(js).kv()).put("probe", b"1")
        await (await StandaloneScheduler(js, "east").kv()).put("probe", b"1")
        await Notifier([], js)._bucket()
        await RepairWatch("east", js, load_catalog(), structlog.get_logger())._state()  # the analyzer's bucket
        await analyzer_kv(js)
        await LedgerStore(js).kv()
        await DriftJudge("east", js)._buckets()
        want_buckets = {*KV_MAX_BYTES, subjects.LEDGER_KV_BUCKET}
        have = {}
        for b in want_buckets:
            info = await js.stream_info(f"KV_{b}")
            have[b] = info.config.num_replicas
            assert len(info.cluster.replicas or []) == 2, (b, info.cluster)  # a leader and two followers
        assert have == {b: 3 for b in want_buckets}
        for stream in (subjects.FAULT_STREAM, subjects.DEADLETTER_STREAM, subjects.PERF_STREAM, subjects.JOB_STREAM,
                       subjects.FINGERPRINT_STREAM):
            assert (await js.stream_info(stream)).config.num_replicas == 3, stream
        # and each server holds its own copy of every one (its own monitoring endpoint)
        for i in range(3):
            jsz = cluster.monitor(i, "jsz?streams=true")
            names = {st["name"] for acc in jsz.get("account_details", []) for st in acc.get("stream_detail", [])}
            assert {f"KV_{b}" for b in want_buckets} | {subjects.FAULT_STREAM} <= names, (i, names)
    finally:
        await close_nats(nc)


async def test_a_bucket_at_another_replica_count_is_left_as_it_is_and_reported(cluster: servers.NatsCluster,
                                                                               tmp_path: Path) -> None:
    one = load_settings(None, nats_url=cluster.url, state_dir=tmp_path)  # replicas 1: a release before the raise
    nc = await connect_nats(one, name="replicas-1")
    try:
        await PermitPool.open(nc.jetstream())
        assert (await nc.jetstream().stream_info(f"KV_{subjects.PERMIT_KV_BUCKET}")).config.num_replicas == 1
    finally:
        await close_nats(nc)
    three = load_settings(None, nats_url=cluster.url, state_dir=tmp_path, streams={"replicas": 3})
    nc = await connect_nats(three, name="replicas-3")
    try:
        js = nc.jetstream()
        jetstream._warned.discard(f"KV_{subjects.PERMIT_KV_BUCKET}")
        with structlog.testing.capture_logs() as logs:
            await open_kv_bucket(js, subjects.PERMIT_KV_BUCKET, "permits")
            await open_kv_bucket(js, subjects.PERMIT_KV_BUCKET, "permits")  # once per process
            assert await report_all_bucket_settings(js) == {subjects.PERMIT_KV_BUCKET: 1}
            await lease_bucket(js)  # created now: at 3, nothing to report
        differ = [x for x in logs if x["event"] == "bucket_settings_differ"]
        assert len(differ) == 1, logs
        assert differ[0]["bucket"] == subjects.PERMIT_KV_BUCKET
        assert differ[0]["differences"] == {"replicas": {"bucket": 1, "configured": 3}}
        assert "nats stream edit KV_fleetmend_permits --replicas 3" in differ[0]["note"]
        assert (await js.stream_info(f"KV_{subjects.PERMIT_KV_BUCKET}")).config.num_replicas == 1  # left as it is
        assert (await js.stream_info(f"KV_{subjects.LEASE_KV_BUCKET}")).config.num_replicas == 3
    finally:
        await close_nats(nc)


async def test_the_client_reaches_the_cluster_with_one_server_down(cluster: servers.NatsCluster,
                                                                   tmp_path: Path) -> None:
    """All three URLs: the first server killed, the client connects to another and KV writes at R3 still
    commit (two of three copies); the killed server comes back with the write."""
    s = load_settings(None, nats_url=cluster.url, state_dir=tmp_path, streams={"replicas": 3})
    nc = await connect_nats(s, name="replicas")
    kv = await lease_bucket(nc.jetstream())
    await close_nats(nc)
    cluster.kill(0)
    nc = await connect_nats(s, name="replicas")
    try:
        assert nc.connected_url is not None and nc.connected_url.port != cluster.ports[0]
        # the bucket's stream may have had its leader on the killed server: the other two elect one (seconds,
        # longer on a loaded CI box, CI run 7), and every process retries its set-up meanwhile: so does this
        deadline = asyncio.get_running_loop().time() + 60
        while True:
            try:
                kv = await lease_bucket(nc.jetstream(timeout=10.0))
                seq = await kv.put("k", b"v")
                break
            except Exception:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(1.0)
        cluster.start(0)
        for _ in range(100):
            jsz = cluster.monitor(0, "jsz?streams=true")
            last = {st["name"]: st["state"]["last_seq"] for acc in jsz.get("account_details", [])
                    for st in acc.get("stream_detail", [])}
            if last.get(f"KV_{subjects.LEASE_KV_BUCKET}") == seq:
                break

            await asyncio.sleep(0.1)
        assert last.get(f"KV_{subjects.LEASE_KV_BUCKET}") == seq, last
    finally:
        await close_nats(nc)
