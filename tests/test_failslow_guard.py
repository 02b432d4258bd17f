"""The fail-slow analyzer's domain findings reach FleetGuard as infrastructure incidents (issue 28, point 2).

On the Temporal time-skipping test server, with the real guard, its permit activities and the
incidents (scheduler and tickets are the recording stand-ins): a domain finding opens one
infrastructure incident (a ticket, nothing drained), the fail_slow incidents of the nodes it explains
are denied (a queued one at once), a fatal fault in the same rack and a fail_slow of a node it does
not explain still drain, and once the analyzer no longer reports the domain its nodes drain again on a
new finding, at once.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

import pytest
from temporalio.testing import WorkflowEnvironment

from fleetmend.dev import servers
from fleetmend.infra.converter import data_converter
from fleetmend.infra.incidents import signal_guard
from fleetmend.messages import DomainFinding, DomainReport, GuardApi, GuardPolicy
from fleetmend.policy import FailureDomain, Topology
from tests.conftest import assert_eventually
from tests.test_fleetguard import Guarded, _incident_settled, register_search_attributes
from tests.test_policy_replay import fail_slow_fault
from tests.test_workflow import fault, start

RACK = ("a", "b", "c", "d")


@pytest.fixture(scope="module")
async def tenv():
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=servers.find_binary("temporal-test-server"), data_converter=data_converter)
    await register_search_attributes(env)
    yield env
    await env.shutdown()


def _topology() -> Topology:
    return Topology({**{n: FailureDomain(rack="r1") for n in RACK}, **{n: FailureDomain(rack="r2") for n in "efg"}})


async def _report(g: Guarded, policy: GuardPolicy, at: int, *findings: DomainFinding) -> None:
    rep = DomainReport(cluster=g.cluster, window_end=datetime.fromtimestamp(1_800_000_000 + at, timezone.utc),
                       findings=list(findings))
    await signal_guard(g.client, g.cluster, g.base, policy, GuardApi.DOMAINS, rep)  # the cluster's queue is derived


async def _status_of(g: Guarded, node: str):
    from workflows.remediation import NodeRemediation

    return await g.node(node).query(NodeRemediation.status)


async def _infra(g: Guarded, pred):
    gs = await g.guard_status()
    return gs if pred(gs.infra_incidents) else None


async def test_a_domain_finding_is_one_infrastructure_incident_and_drains_none_of_its_nodes(tenv, nc) -> None:
    policy = GuardPolicy(max_drained_nodes=10, max_drained_percent=100.0, max_drained_per_rack=4,
                         domain_incident_nodes=50, breaker_distinct_nodes=50, cluster_nodes=100)
    async with Guarded(tenv, nc, policy, _topology()) as g:
        rack = DomainFinding(key="rack:r1", nodes=["a", "b", "c"], metrics=["sm_clock_ratio", "thermal_frac"],
                             windows=3, share=0.75)
        await _report(g, policy, 300, rack)
        gs = await assert_eventually(lambda: _infra(g, lambda inc: len(inc) == 1), what="the incident opened")
        inc = gs.infra_incidents[0]
        assert (inc["domain"], inc["source"], inc["nodes"], inc["closed_at"]) == ("rack:r1", "analyzer",
                                                                                  ["a", "b", "c"], None)
        await assert_eventually(lambda: [t for t in g.calls.tickets if t.fault_class == "infrastructure"],
                                what="a human paged")
        ticket = next(t for t in g.calls.tickets if t.fault_class == "infrastructure")
        assert "rack:r1" in ticket.title and "slower" in ticket.title and ticket.evidence["source"] == "analyzer"

        # a fail_slow the domain explains: denied as the domain's; one it does not (e, another rack): drained
        for n in ("a", "e"):
            await start(g.client, g.tq, g.cluster, n, [fail_slow_fault(g.cluster, n)])
            await assert_eventually(lambda n=n: _incident_settled(g, n), what=f"{n} decided")
        st = await _status_of(g, "a")
        assert st.outcome == "infrastructure_incident" and not st.drained, st.timeline[-3:]
        assert any("explained by infrastructure incident rack:r1" in e["text"] for e in st.timeline), st.timeline
        assert (await _status_of(g, "e")).drained
        # a fatal fault in the same rack is no slowness: it drains (the pool's rack:r1 stays open)
        await start(g.client, g.tq, g.cluster, "b", [fault(g.cluster, "b", 79, drain=True)])
        await assert_eventually(lambda: _incident_settled(g, "b"), what="b decided")
        assert (await _status_of(g, "b")).drained
        assert [n for op, n in g.calls.log if op == "drain"] == ["e", "b"]
        assert (await g.guard_status()).breaker_tripped is False

        # the rack cleared: the incident closes, and a node it explained is judged (and drained) at once
        await _report(g, policy, 1200)
        gs = await assert_eventually(lambda: _infra(g, lambda inc: inc[0]["closed_at"] is not None),
                                     what="the incident closed")
        assert "no longer reports" in gs.infra_incidents[0]["closed_why"]
        await start(g.client, g.tq, g.cluster, "c", [fail_slow_fault(g.cluster, "c")])
        await assert_eventually(lambda: _incident_settled(g, "c"), what="c decided")
        assert (await _status_of(g, "c")).drained


async def test_a_queued_fail_slow_is_denied_when_its_domain_is_reported(tenv, nc) -> None:
    policy = GuardPolicy(max_drained_nodes=1, max_drained_percent=100.0, max_drained_per_rack=4,
                         domain_incident_nodes=50, breaker_distinct_nodes=50, cluster_nodes=100)
    async with Guarded(tenv, nc, policy, _topology()) as g:
        await start(g.client, g.tq, g.cluster, "f", [fault(g.cluster, "f", 79, drain=True)])
        await assert_eventually(lambda: _incident_settled(g, "f"), what="f holds the budget")
        await start(g.client, g.tq, g.cluster, "d", [fail_slow_fault(g.cluster, "d")])

        async def queued():
            gs = await g.guard_status()
            return gs if [q["node"] for q in gs.queue] == ["d"] else None

        await assert_eventually(queued, what="d queued behind the budget")
        await _report(g, policy, 300, DomainFinding(key="inferred:1800000000", nodes=["d", "g"],
                                                     metrics=["temperature_c"], windows=3))
        await assert_eventually(lambda: _incident_settled(g, "d"), what="d decided")
        st = await _status_of(g, "d")
        assert st.outcome == "infrastructure_incident" and not st.drained
        assert [n for op, n in g.calls.log if op == "drain"] == ["f"]
        # an older report arriving late changes nothing; a newer one without the domain closes it
        await _report(g, policy, 0)
        await asyncio.sleep(1.0)
        gs = await g.guard_status()
        assert gs.infra_incidents[0]["closed_at"] is None
        await _report(g, policy, 600)
        await assert_eventually(lambda: _infra(g, lambda inc: inc[0]["closed_at"] is not None), what="closed")
