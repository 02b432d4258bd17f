"""FleetGuard's derived window index (`workflows.fleetguard.RecentIndex`) against the scans it replaced,
and the cost of a burst's requests in one workflow task.

The index is never carried or recorded, so it must equal, after any sequence of appends, expiries of the
oldest entries, a node's domains changing and the window being replaced (breaker reset, a new run), what
scanning `recent` says: its distinct nodes (the breaker) and each failure domain's nodes (infrastructure
incidents)."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone

from hypothesis import given, settings
from hypothesis import strategies as st

import workflows.fleetguard as fg
from fleetmend.events import Severity
from fleetmend.messages import GuardInput, GuardPolicy, PermitRequest
from workflows.fleetguard import RecentIndex

NODES = [f"n{i}" for i in range(8)]
DOMAINS = ["rack:a", "rack:b", "leaf:x", "pdu:p"]

ops = st.lists(st.one_of(
    st.tuples(st.just("append"), st.sampled_from(NODES)),
    st.tuples(st.just("expire"), st.integers(0, 6)),
    st.tuples(st.just("domains"), st.sampled_from(NODES), st.lists(st.sampled_from(DOMAINS), max_size=3, unique=True)),
    st.tuples(st.just("replace"),),
), max_size=60)


@given(ops)
@settings(max_examples=300)
def test_index_equals_the_scan(seq: list[tuple]) -> None:
    recent: list[tuple[str, int]] = []
    node_domains: dict[str, list[str]] = {n: [DOMAINS[i % 2], "leaf:x"] for i, n in enumerate(NODES[:4])}
    ix = RecentIndex()
    t = 0
    for op in seq:
        if op[0] == "append":
            t += 1
            recent.append((op[1], t))
        elif op[0] == "expire":
            k = min(op[1], len(recent))
            if k:
                ix.drop_oldest(recent, k, node_domains)
        elif op[0] == "domains":  # as FleetGuard._request does: a changed node's entries count anew
            old = node_domains.get(op[1])
            node_domains[op[1]] = list(op[2])
            if old != node_domains[op[1]] and op[1] in ix.nodes:
                ix.invalidate()
        else:
            recent = []
        ix.sync(recent, node_domains)
        assert set(ix.nodes) == {n for n, _ in recent}
        for d in DOMAINS:
            assert set(ix.domains.get(d, {})) == {n for n, _ in recent if d in node_domains.get(n, [])}, (d, op)


def test_a_burst_in_one_task_is_linear(monkeypatch) -> None:
    """3,000 forwarded requests in one `_process` (one workflow task) keep every decision of the scans:
    all queued behind a full budget, the breaker and the domains counted. It took 3.3 s by scans on
    these 2 cores (the SDK fails an activation past 2 s); bench/RESULTS.md has the figures."""
    t0 = datetime(2026, 12, 1, tzinfo=timezone.utc)
    monkeypatch.setattr(fg.workflow, "now", lambda: t0)
    monkeypatch.setattr(fg.workflow, "logger", logging.getLogger("test_guard_index"))
    monkeypatch.setattr(fg.workflow, "patched", lambda _id: True)  # a run started with this code
    pol = GuardPolicy(max_drained_nodes=20, max_drained_percent=100.0, breaker_distinct_nodes=2_999,
                      domain_incident_nodes=10_000)
    g = fg.FleetGuard(GuardInput(cluster="c", policy=pol))
    reqs = [PermitRequest(cluster="c", node=f"m{i:05d}", severity=Severity.FATAL, fault_class="xid79",
                          rack=f"r{i // 16:03d}", domains=[f"rack:r{i // 16:03d}", f"leaf:l{i // 64:03d}"],
                          policy=pol, requested_at=t0 - timedelta(seconds=i), forwarded=True) for i in range(3_000)]
    g._inbox.extend(reqs + reqs[:10])  # ten asked twice: same place, no duplicate
    g._process()
    s = g._state
    assert len(s.queue) == 3_000 and len({q.node for q in s.queue}) == 3_000 and len(s.recent) == 3_000
    assert s.breaker_tripped and "3000 distinct nodes" in s.breaker_reason  # more than 2,999
    assert len(g._recent().domains["leaf:l000"]) == 64 and not s.infra
