"""NATS authorization with credentials from `fleetmend creds generate`, against a real nats-server
started with the generated accounts block: a node publishes only its own subjects, answers only its
own diagnostics, cannot read other clients' replies; an unauthenticated client is refused; router and
worker credentials do their jobs; the agent's real publishing path works with node credentials."""

from __future__ import annotations

import asyncio
import json
import stat
from pathlib import Path

import nats
import pytest
from typer.testing import CliRunner

from fleetmend import subjects
from fleetmend.config import load_settings
from fleetmend.dev import servers
from fleetmend.errors import ConfigError, ServiceUnavailableError
from fleetmend.events import Component, Device, FaultEvent, Severity, Source
from fleetmend.infra import security
from fleetmend.infra.connect import connect_nats
from fleetmend.infra.jetstream import ensure_deadletter_stream, ensure_fault_stream
from tests.conftest import assert_eventually

CLUSTER = "sec"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory):
    """nats-server with the generated accounts (nodes n1, n2), JetStream on. Yields (url, CredentialSet)."""
    d = tmp_path_factory.mktemp("secnats")
    cs = security.generate(d / "creds", CLUSTER, ["n1", "n2"])
    conf = d / "nats.conf"
    conf.write_text(security.server_conf(cs.accounts_conf))
    port = servers.free_port()
    proc = servers.start_nats(d / "js", port, config_file=conf)
    url = f"nats://127.0.0.1:{port}"

    async def setup() -> None:
        nc = await nats.connect(url, nkeys_seed=str(cs.seed_file("admin")))
        await ensure_fault_stream(nc.jetstream())
        await ensure_deadletter_stream(nc.jetstream())
        await nc.close()

    asyncio.run(setup())
    yield url, cs
    proc.stop()


async def node_client(url: str, cs, node: str, errors: list | None = None):
    async def error_cb(err: Exception) -> None:
        if errors is not None:
            errors.append(str(err))

    return await nats.connect(url, nkeys_seed=str(cs.seed_file(f"node:{CLUSTER}/{node}")),
                              inbox_prefix=security.node_inbox_prefix(CLUSTER, node), error_cb=error_cb)


async def stream_ids(url: str, cs, subject: str) -> list[str]:
    """Event ids stored in the fault stream on `subject` (read with admin credentials)."""
    nc = await nats.connect(url, nkeys_seed=str(cs.seed_file("admin")))
    try:
        js = nc.jetstream()
        info = await js.stream_info(subjects.FAULT_STREAM, subjects_filter=subject)
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                m = await js.get_msg(subjects.FAULT_STREAM, seq)
            except Exception:
                continue
            if m.subject == subject:
                out.append(json.loads(m.data).get("event_id"))
        return out
    finally:
        await nc.close()


def event(node: str) -> FaultEvent:
    return FaultEvent(cluster=CLUSTER, node=node, component=Component.GPU, kind="xid", code=79,
                      severity=Severity.FATAL, source=Source.INJECT, device=Device(pci_bus_id="0000:3b:00.0"))


def test_generate_permissions_files_and_reuse(tmp_path: Path):
    cs = security.generate(tmp_path, "c1", ["a", "b"])
    perms = security.node_permissions("c1", "a")
    assert perms["publish"]["allow"] == [
        "fleet.c1.fault.a", "fleet.c1.hb.a", "fleet.c1.perf.a", "fleet.c1.job.a.*", "fleet.c1.fingerprint.a",
        "$KV.fleetmend_fingerprints.c1.a", "$JS.API.STREAM.INFO.FLEET_FINGERPRINTS",
        "$JS.API.STREAM.INFO.KV_fleetmend_fingerprints",
        "$JS.API.DIRECT.GET.KV_fleetmend_fingerprints.$KV.fleetmend_fingerprints.c1.a"]
    assert perms["subscribe"]["allow"] == ["fleet.c1.diag.a", "fleet.c1.reconfigure.a", "_INBOX.c1.a.>"]
    seed = cs.seed_file("node:c1/a")
    assert stat.S_IMODE(seed.stat().st_mode) == 0o600
    assert seed.read_bytes().startswith(b"SU")
    conf = cs.accounts_conf.read_text()
    assert "fleet.c1.fault.a" in conf and "jetstream: enabled" in conf
    before = {c.name: c.public_key for c in cs.credentials}
    again = security.generate(tmp_path, "c1", ["a", "b", "c"])
    after = {c.name: c.public_key for c in again.credentials}
    assert all(after[k] == v for k, v in before.items()), "adding a node rotates no existing key"
    toml = (tmp_path / "nodes" / "a.toml").read_text()
    s = load_settings((tmp_path / "nodes" / "a.toml"))
    assert s.node == "a" and s.nats_inbox_prefix == "_INBOX.c1.a" and s.nats_nkey_seed == seed.resolve(), toml
    with pytest.raises(ConfigError, match="invalid node name"):
        security.generate(tmp_path, "c1", ["bad name"])
    with pytest.raises(ConfigError, match="expected router, worker, analyzer, admin"):
        security.role_permissions("root")
    for role in ("router", "worker"):
        perms = security.role_permissions(role)
        granted = perms["publish"]["allow"] + perms["subscribe"]["allow"]
        assert "$JS.API.>" not in granted and "_INBOX.>" not in granted, (role, granted)
        assert load_settings(tmp_path / f"{role}.toml").nats_inbox_prefix == security.role_inbox_prefix(role)
    assert "fleet.*.hb.*" in security.role_permissions("router")["subscribe"]["allow"]


def test_creds_cli(tmp_path: Path):
    from fleetmend.cli.app import app

    r = CliRunner().invoke(app, ["creds", "generate", "--out", str(tmp_path), "--cluster", "c9", "--nodes", "x1,x2"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "nodes" / "x2.nk").exists() and (tmp_path / "accounts.conf").exists()
    r = CliRunner().invoke(app, ["creds", "generate", "--out", str(tmp_path), "--cluster", "c9"])
    assert r.exit_code == 2 and "no nodes" in r.output


async def test_node_publishes_own_subject_only(secured):
    url, cs = secured
    errors: list[str] = []
    nc = await node_client(url, cs, "n1", errors)
    try:
        js = nc.jetstream()
        own = event("n1")
        ack = await js.publish(subjects.fault_subject(CLUSTER, "n1"), own.to_json_bytes(),
                               headers={"Nats-Msg-Id": own.event_id})
        assert ack.stream == subjects.FAULT_STREAM
        spoof = event("n2")
        with pytest.raises(asyncio.TimeoutError):  # the server drops it: no ack ever comes
            await js.publish(subjects.fault_subject(CLUSTER, "n2"), spoof.to_json_bytes(), timeout=1.0)
        await assert_eventually(lambda: any("permissions violation for publish" in e and "fleet.sec.fault.n2" in e
                                            for e in errors), what="permissions violation via error_cb")
        assert own.event_id in await stream_ids(url, cs, subjects.fault_subject(CLUSTER, "n1"))
        assert spoof.event_id not in await stream_ids(url, cs, subjects.fault_subject(CLUSTER, "n2"))
        await nc.publish(subjects.heartbeat_subject(CLUSTER, "n1"), b"{}")  # own heartbeat: allowed
        await nc.publish(subjects.heartbeat_subject(CLUSTER, "n2"), b"{}")
        await nc.publish(subjects.DEADLETTER_SUBJECT, b"{}")
        await assert_eventually(lambda: any("fleet.sec.hb.n2" in e for e in errors)
                                and any("fleet.deadletter" in e for e in errors), what="hb/deadletter refused")
        assert not any("fleet.sec.hb.n1" in e for e in errors)
        assert nc.is_connected, "a violation does not cost the node its connection"
    finally:
        await nc.close()


async def test_unauthenticated_and_unknown_key_refused(secured, tmp_path: Path):
    url, _cs = secured
    with pytest.raises(Exception, match="Authorization Violation"):
        await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    stranger = tmp_path / "stranger.nk"
    stranger.write_bytes(security.new_seed())
    s = load_settings(None, nats_url=url, nats_nkey_seed=stranger)
    with pytest.raises(ServiceUnavailableError, match="refused this client's credentials"):
        await connect_nats(s, name="stranger", allow_reconnect=False, max_reconnect_attempts=0)


async def test_node_answers_own_diag_only_and_cannot_eavesdrop(secured):
    url, cs = secured
    errors: list[str] = []
    n1 = await node_client(url, cs, "n1", errors)
    worker = await nats.connect(url, nkeys_seed=str(cs.seed_file("worker")), inbox_prefix=security.role_inbox_prefix("worker"))
    try:
        async def answer(msg) -> None:
            await msg.respond(b"n1 ok")

        await n1.subscribe(subjects.diag_subject(CLUSTER, "n1"), cb=answer)
        await n1.subscribe(subjects.diag_subject(CLUSTER, "n2"), cb=answer)  # refused by the server
        await n1.subscribe("_INBOX.>", cb=answer)  # other clients' replies: refused
        await n1.subscribe("fleet.>", cb=answer)
        await n1.flush()

        async def answered() -> bytes | None:
            # the subscription's interest can lag the flush by a moment on a loaded 2-core box
            try:
                return (await worker.request(subjects.diag_subject(CLUSTER, "n1"), b"{}", timeout=3)).data
            except nats.errors.NoRespondersError:
                return None

        assert await assert_eventually(answered, timeout_s=10, what="n1 answers its own diag") == b"n1 ok"
        with pytest.raises((nats.errors.NoRespondersError, nats.errors.TimeoutError)):
            await worker.request(subjects.diag_subject(CLUSTER, "n2"), b"{}", timeout=1)
        await assert_eventually(lambda: sum("permissions violation for subscription" in e for e in errors) >= 3,
                                what="three refused subscriptions")
        with_n2 = [e for e in errors if "subscription" in e]
        assert any("fleet.sec.diag.n2" in e for e in with_n2) and any('"_inbox.>"' in e.lower() for e in with_n2)
        # allow_responses lets n1 reply to a request it received, not publish into anyone's inbox at will
        await n1.publish("_INBOX.someone.else", b"spoofed reply")
        await assert_eventually(lambda: any("_inbox.someone.else" in e.lower() for e in errors), what="inbox spoof refused")
    finally:
        await n1.close()
        await worker.close()


async def test_router_and_worker_credentials_do_their_jobs(secured, unique):
    url, cs = secured
    router = await nats.connect(url, nkeys_seed=str(cs.seed_file("router")),
                                inbox_prefix=security.role_inbox_prefix("router"))
    worker = await nats.connect(url, nkeys_seed=str(cs.seed_file("worker")),
                                inbox_prefix=security.role_inbox_prefix("worker"))
    n2 = await node_client(url, cs, "n2")
    try:
        ev = event("n2")
        await n2.jetstream().publish(subjects.fault_subject(CLUSTER, "n2"), ev.to_json_bytes(),
                                     headers={"Nats-Msg-Id": ev.event_id})
        js = router.jetstream()
        # the router's own durable (its credentials name exactly that consumer of the fault stream)
        psub = await js.pull_subscribe(subjects.fault_subject(CLUSTER, "n2"), durable=subjects.ROUTER_DURABLE,
                                       stream=subjects.FAULT_STREAM)
        msgs = await psub.fetch(10, timeout=3)
        assert ev.event_id in [json.loads(m.data)["event_id"] for m in msgs]
        for m in msgs:
            await m.ack()
        await js.publish(subjects.DEADLETTER_SUBJECT, b'{"reason": "test"}')
        # agent_silent events for silent nodes go to the node's fault subject
        await js.publish(subjects.fault_subject(CLUSTER, "n1"), ev.to_json_bytes(), timeout=3.0)
        with pytest.raises((asyncio.TimeoutError, nats.errors.Error)):  # no blanket $JS.API.>
            await js.delete_stream(subjects.FAULT_STREAM)
        with pytest.raises((asyncio.TimeoutError, nats.errors.Error)):  # nor another consumer
            await js.pull_subscribe(subjects.fault_subject(CLUSTER, "n2"), durable=f"r-{unique}",
                                    stream=subjects.FAULT_STREAM)
        with pytest.raises((asyncio.TimeoutError, nats.errors.Error)):  # the worker cannot read faults
            await worker.jetstream().get_msg(subjects.FAULT_STREAM, 1)

        from activities.standalone import StandaloneScheduler

        sched = StandaloneScheduler(worker.jetstream(), bucket=subjects.DRAIN_KV_BUCKET)
        res = await sched.drain(f"node-{unique}", "test", "inc-1")  # creates its bucket on first use
        assert res.drained and res.owned
        assert f"node-{unique}" in [r.name for r in await sched.list_nodes()]  # key listing: a consumer
        assert (await sched.undrain(f"node-{unique}", "inc-1")).resumed

        # the worker keeps the shared ticket ledger; worker and router contend for gauge-publisher leases
        from activities.ticket_kv import KvTicketStore
        from fleetmend.infra.lease import KvLease, lease_bucket, lease_key
        from fleetmend.messages import TicketRequest

        ref = await KvTicketStore(worker.jetstream()).file(TicketRequest(
            incident_id=f"inc-{unique}", cluster=CLUSTER, node="n2", title="t", severity="fatal",
            fault_class="xid79", evidence={}))
        assert ref.created
        for role, c in (("router-lag", router), ("incident-poller", worker)):
            assert await KvLease(await lease_bucket(c.jetstream()), lease_key(role, unique), role).tick()

        # the guard's worker writes the permit pool; the router claims a slot and drains (a fault that must drain now)
        from fleetmend.infra.permit_pool import PermitPool

        await (await PermitPool.open(worker.jetstream())).publish(f"pp{unique}", budget=2, rack_cap=2, open=True)
        claim = await (await PermitPool.open(router.jetstream())).claim(f"pp{unique}", "n2", None)
        assert claim.ok and claim.new
        fast = StandaloneScheduler(router.jetstream(), bucket=subjects.DRAIN_KV_BUCKET)
        assert (await fast.drain(f"fast-{unique}", "test", "fast-1")).owned
    finally:
        for c in (router, worker, n2):
            await c.close()


async def test_agent_publishes_and_answers_with_node_credentials(secured, tmp_path: Path):
    """The real agent (publisher, spool, diag responder) with only n1's credentials: its events are
    acked by JetStream (nothing left in the spool) and the worker's diagnostics request is answered."""
    from agents.probes import InjectProbe
    from agents.runner import run_agent

    url, cs = secured
    ev = event("n1")
    inject = tmp_path / "inject.jsonl"
    inject.write_bytes(ev.to_json_bytes() + b"\n")
    s = load_settings(cs.credentials[0].settings_file, nats_url=url, state_dir=tmp_path / "state",
                      agent={"nice": 0, "publish_timeout_s": 2.0})
    assert s.node == "n1"
    stop = asyncio.Event()
    task = asyncio.create_task(run_agent(s, stop=stop, probes=[InjectProbe(inject, CLUSTER, "n1")], nvml=None,
                                         shutdown_timeout_s=3.0))
    worker = await nats.connect(url, nkeys_seed=str(cs.seed_file("worker")), inbox_prefix=security.role_inbox_prefix("worker"))
    try:
        async def stored() -> bool:
            return ev.event_id in await stream_ids(url, cs, subjects.fault_subject(CLUSTER, "n1"))

        await assert_eventually(stored, timeout_s=20, what="agent's event in the stream")

        async def diag_answer():
            try:
                return await worker.request(subjects.diag_subject(CLUSTER, "n1"), b'{"level": "quick"}', timeout=5)
            except nats.errors.NoRespondersError:
                return None

        reply = await assert_eventually(diag_answer, timeout_s=20, what="diagnostics answered")
        assert json.loads(reply.data)["node"] == "n1"
    finally:
        stop.set()
        rc = await task
        await worker.close()
    assert rc == 0


async def test_a_node_writes_only_its_own_fingerprint(secured):
    """The analyzer's credentials create the fingerprint stores; a node's may read their info, write its
    own key of the latest-fingerprint bucket and its own change records, and nothing of another node's."""
    from fleetmend.infra.jetstream import ensure_fingerprint_stores

    url, cs = secured
    an = await nats.connect(url, nkeys_seed=str(cs.seed_file("analyzer")), inbox_prefix=security.role_inbox_prefix("analyzer"))
    await ensure_fingerprint_stores(an.jetstream())
    await an.close()
    errors: list[str] = []
    nc = await node_client(url, cs, "n1", errors)
    try:
        js = nc.jetstream()
        kv = await ensure_fingerprint_stores(js)  # exists: the node only reads the stores' info
        await kv.put(subjects.fingerprint_kv_key(CLUSTER, "n1"), b"{}")
        assert (await kv.get(subjects.fingerprint_kv_key(CLUSTER, "n1"))).value == b"{}"  # its own, read back
        ack = await js.publish(subjects.fingerprint_subject(CLUSTER, "n1"), b"{}")
        assert ack.stream == subjects.FINGERPRINT_STREAM
        with pytest.raises((asyncio.TimeoutError, nats.errors.Error)):  # refused by the server: no ack
            await kv.put(subjects.fingerprint_kv_key(CLUSTER, "n2"), b"{}")
        with pytest.raises(asyncio.TimeoutError):
            await js.publish(subjects.fingerprint_subject(CLUSTER, "n2"), b"{}", timeout=1.0)
        await assert_eventually(lambda: any("permissions violation for publish" in e and "fingerprint" in e
                                            for e in errors), what="the other node's fingerprint refused")
    finally:
        await nc.close()


async def test_router_and_worker_credentials_keep_the_incident_ledger(secured, unique):
    """The router notes a routed fault, the worker opens, closes and reads the record, reads the fleet's
    fingerprints for version findings: all under their own credentials, no ledger write failing (issue 26)."""
    from datetime import datetime, timezone

    from fleetmend.fingerprint import Fingerprint
    from fleetmend.infra import metrics
    from fleetmend.infra.jetstream import ensure_fingerprint_stores
    from fleetmend.infra.ledger import LedgerStore

    url, cs = secured
    admin = await nats.connect(url, nkeys_seed=str(cs.seed_file("admin")))
    router = await nats.connect(url, nkeys_seed=str(cs.seed_file("router")),
                                inbox_prefix=security.role_inbox_prefix("router"))
    worker = await nats.connect(url, nkeys_seed=str(cs.seed_file("worker")),
                                inbox_prefix=security.role_inbox_prefix("worker"))
    n2 = await node_client(url, cs, "n2")
    failures = sum(s.value for s in metrics.LEDGER_WRITE_FAILURES.collect()[0].samples if s.name.endswith("_total"))
    try:
        await ensure_fingerprint_stores(admin.jetstream())  # the analyzer creates the stores
        kv = await n2.jetstream().key_value(subjects.FINGERPRINT_KV_BUCKET)
        await kv.put(subjects.fingerprint_kv_key(CLUSTER, "n2"), Fingerprint(
            cluster=CLUSTER, node="n2", versions={"nvidia_driver": "550.90.07"}, serials={"0000:3b:00.0": "GPU-1"}
        ).to_json_bytes())
        now = datetime.now(timezone.utc)
        await LedgerStore(router.jetstream()).note_routed(CLUSTER, "n2", [
            {"observed_at": now.timestamp(), "routed_at": now.timestamp(), "fault_class": "xid79", "kind": "xid",
             "code": 79, "device": "0000:3b:00.0"}])
        store = LedgerStore(worker.jetstream())
        iid = f"remediate/{CLUSTER}/n2/{unique}"
        await store.drained(cluster=CLUSTER, node="n2", incident_id=iid, workflow_id=f"remediate/{CLUSTER}/n2",
                            observed_at=now, reason="xid79 incident", drained=True, state="drained")
        await store.closed(cluster=CLUSTER, node="n2", workflow_id=f"remediate/{CLUSTER}/n2", outcome="aborted")
        heads = [h for h in await store.read_heads(CLUSTER) if h["incident_id"] == iid]
        assert len(heads) == 1 and heads[0]["part_serial_drain"] == "GPU-1" and heads[0]["outcome"] == "aborted"
        assert heads[0]["routed_at"] == pytest.approx(now.timestamp())
        assert [f["node"] for f in await store.fleet(CLUSTER)] == ["n2"]
        # the worker's elected replica rolls it up: the pack written, the record's own message purged
        rolled = await store.roll_up(CLUSTER)
        assert rolled["records"] >= 1 and rolled["purged"] == rolled["records"] and not rolled["left"], rolled
        heads = [h for h in await store.read_heads(CLUSTER, with_detail=True) if h["incident_id"] == iid]
        assert len(heads) == 1 and heads[0]["_key"].startswith(f"inc.{CLUSTER}.n2.")
        after = sum(s.value for s in metrics.LEDGER_WRITE_FAILURES.collect()[0].samples if s.name.endswith("_total"))
        assert after == failures, "a ledger write was refused"
    finally:
        for c in (admin, router, worker, n2):
            await c.close()
