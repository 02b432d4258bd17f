"""KubernetesScheduler against kmock's KubernetesEmulator through the official `kubernetes` client.

No real kube-apiserver runs in CI. kmock stores objects and
answers read/list/create/patch/delete over HTTP like the API server; it does not have the Eviction
subresource, PodDisruptionBudgets, selectors or resourceVersion. The eviction endpoint is scripted
below the way the API server behaves (policy/v1 Eviction → 201 and the pod goes; 429 with a Status
body while a budget forbids it), and a 409 precondition failure is scripted once.
"""

from __future__ import annotations

import kmock
import pytest
from temporalio.testing import ActivityEnvironment

from activities.kubernetes import KubernetesScheduler, evictable, taint_value
from activities.scheduler import SchedulerActivities, build_scheduler
from fleetmend.config import KubernetesSettings, Settings
from fleetmend.errors import NodeNotFoundError, SchedulerError
from fleetmend.messages import DrainRequest

PODS = kmock.resource("", "v1", "pods")
NODES = kmock.resource("", "v1", "nodes")


class Cluster:
    """The emulator plus a scripted Eviction endpoint with per-pod budgets."""

    def __init__(self, k8s: kmock.KubernetesEmulator, url: str) -> None:
        self.k8s, self.url = k8s, url
        self.budget_refusals: dict[str, int] = {}
        """`ns/name` → how many more evictions a PodDisruptionBudget refuses (429); -1 forever."""
        self.evictions: list[dict] = []
        self.fail_next_patch_409 = 0
        self.pristine: dict[str, dict] = {}

    def evict(self, request):
        key = f"{request.namespace}/{request.name}"
        self.evictions.append({"key": key, "body": request.data, "method": request.method})
        if (PODS, request.namespace, request.name) not in self.k8s.objects:
            return kmock.Response(status=404, payload=_status(404, "NotFound", f'pods "{request.name}" not found'))
        left = self.budget_refusals.get(key, 0)
        if left:
            self.budget_refusals[key] = left - 1 if left > 0 else -1
            return kmock.Response(status=429, payload=_status(
                429, "TooManyRequests", "Cannot evict pod as it would violate the pod's disruption budget."))
        del self.k8s.objects[PODS, request.namespace, request.name]
        return kmock.Response(status=201, payload={"kind": "Status", "apiVersion": "v1", "status": "Success",
                                                   "code": 201})

    def patch_conflict(self, request):
        if self.fail_next_patch_409 > 0:
            self.fail_next_patch_409 -= 1
            # kmock stores the patch before reactions run: put the node back, as a refused precondition would.
            self.k8s.objects[NODES, None, request.name] = self.pristine[request.name]
            return kmock.Response(status=409, payload=_status(409, "Conflict", "the object has been modified"))
        return None  # fall through to the emulator

    def node(self, name: str, *, unschedulable: bool = False, taints: list | None = None,
             annotations: dict | None = None) -> None:
        self.pristine[name] = {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"nvidia.com/gpu.present": "true"}, "annotations": annotations or {}},
            "spec": {"unschedulable": unschedulable, "taints": taints or []},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
        self.k8s.objects[NODES, None, name] = self.pristine[name]

    def pod(self, ns: str, name: str, node: str, *, owner_kind: str | None = None, phase: str = "Running",
            mirror: bool = False) -> None:
        md: dict = {"name": name, "namespace": ns}
        if owner_kind:
            md["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": owner_kind, "name": "x", "uid": "u",
                                      "controller": True}]
        if mirror:
            md["annotations"] = {"kubernetes.io/config.mirror": "abc"}
        self.k8s.objects[PODS, ns, name] = {"apiVersion": "v1", "kind": "Pod", "metadata": md,
                                            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "i"}]},
                                            "status": {"phase": phase}}

    def read(self, kind, name: str, ns: str | None = None) -> dict:
        return dict(self.k8s.objects[kind, ns, name])

    def pods(self) -> list[str]:
        return sorted(f"{k[1]}/{k[2]}" for k in self.k8s.objects.keys() if k[0] == PODS)


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


@pytest.fixture
async def cluster():
    async with kmock.KubernetesEmulator() as k8s, kmock.Server(k8s) as srv:
        k8s.resources["v1/pods"] = {}
        k8s.resources["v1/nodes"] = {}
        c = Cluster(k8s, str(srv.url).rstrip("/"))
        k8s["post", kmock.subresource("eviction")] << c.evict
        k8s["patch", NODES] << c.patch_conflict
        yield c


def sched(c: Cluster, **kw) -> KubernetesScheduler:
    return KubernetesScheduler(KubernetesSettings(api_url=c.url, evict_retry_s=0.05, **kw))


def test_taint_value_is_a_valid_label_value() -> None:
    assert taint_value("xid_79 incident i-1") == "xid_79"
    assert taint_value("gpu/fell off") == "gpu_fell"
    assert taint_value("") == "fault"
    assert len(taint_value("x" * 100 + " y")) == 63


async def test_drain_cordons_taints_annotates_and_evicts(cluster: Cluster) -> None:
    c = cluster
    c.node("gpu-001", taints=[{"key": "team", "value": "ml", "effect": "NoSchedule"}])
    c.pod("default", "train-0", "gpu-001")
    c.pod("ml", "train-1", "gpu-001")
    c.pod("kube-system", "dcgm-exporter-x", "gpu-001", owner_kind="DaemonSet")
    c.pod("kube-system", "static-x", "gpu-001", mirror=True)
    c.pod("default", "done-job", "gpu-001", phase="Succeeded")
    c.pod("default", "elsewhere", "gpu-002")
    s = sched(c)
    r = await s.drain("gpu-001", "xid_79 incident inc-1", "inc-1")
    assert (r.drained, r.owned, r.operator_drained, r.state) == (True, True, False, "drained")
    assert "evicted 2" in r.detail
    n = c.read(NODES, "gpu-001")
    assert n["spec"]["unschedulable"] is True
    assert {"key": "team", "value": "ml", "effect": "NoSchedule"} in n["spec"]["taints"]
    assert {"key": "fleetmend.io/fault", "value": "xid_79", "effect": "NoSchedule"} in n["spec"]["taints"]
    ann = n["metadata"]["annotations"]
    assert ann["fleetmend.io/cordon-owner"] == "fleetmend" and ann["fleetmend.io/incident"] == "inc-1"
    # Evicted through policy/v1 Eviction objects naming the pod; DaemonSet/mirror/finished pods stay.
    assert sorted(e["key"] for e in c.evictions) == ["default/train-0", "ml/train-1"]
    body = c.evictions[0]["body"]
    assert body["apiVersion"] == "policy/v1" and body["kind"] == "Eviction"
    assert body["metadata"]["name"] in ("train-0", "train-1")
    assert c.pods() == ["default/done-job", "default/elsewhere", "kube-system/dcgm-exporter-x",
                        "kube-system/static-x"]
    assert await s.state("gpu-001") == "drained"

    # Idempotent: a second drain (an activity retry) sends no patch and evicts nothing new.
    patches = s.patch_calls
    r2 = await s.drain("gpu-001", "xid_79 incident inc-1", "inc-1")
    assert r2.owned and s.patch_calls == patches

    # Undrain removes only what fleetmend added.
    u = await s.undrain("gpu-001", "inc-1")
    assert u.resumed and not u.operator_drained
    n = c.read(NODES, "gpu-001")
    assert n["spec"]["unschedulable"] is False
    assert n["spec"]["taints"] == [{"key": "team", "value": "ml", "effect": "NoSchedule"}]
    assert not any(k.startswith("fleetmend.io/") for k in n["metadata"].get("annotations") or {})
    u2 = await s.undrain("gpu-001", "inc-1")
    assert not u2.resumed and "nothing to resume" in u2.detail


async def test_operator_cordon_is_remembered_and_never_lifted(cluster: Cluster) -> None:
    c = cluster
    c.node("gpu-003", unschedulable=True, annotations={"ops/ticket": "MAINT-7"})
    c.pod("default", "train-0", "gpu-003")
    s = sched(c)
    r = await s.drain("gpu-003", "ecc_dbe incident inc-3", "inc-3")
    assert (r.drained, r.owned, r.operator_drained) == (True, False, True)
    n = c.read(NODES, "gpu-003")
    assert n["metadata"]["annotations"]["fleetmend.io/cordon-owner"] == "operator"
    assert n["metadata"]["annotations"]["ops/ticket"] == "MAINT-7"
    assert any(t["key"] == "fleetmend.io/fault" for t in n["spec"]["taints"])
    assert c.evictions == []  # the operator's drain: pods are theirs to move
    rows = {x.name: x for x in await s.list_nodes()}
    assert rows["gpu-003"].owner == "operator" and rows["gpu-003"].incident_id == "inc-3"

    u = await s.undrain("gpu-003", "inc-3")
    assert not u.resumed and u.operator_drained
    n = c.read(NODES, "gpu-003")
    assert n["spec"]["unschedulable"] is True  # never uncordoned by fleetmend
    assert n["spec"]["taints"] == []
    assert n["metadata"]["annotations"] == {"ops/ticket": "MAINT-7"}

    # Cordoned by someone, nothing of fleetmend's on it: left alone.
    u = await s.undrain("gpu-003", "inc-3")
    assert not u.resumed and u.operator_drained


async def test_pdb_429_is_retried_until_the_budget_allows(cluster: Cluster) -> None:
    c = cluster
    c.node("gpu-004")
    c.pod("default", "db-0", "gpu-004")
    c.budget_refusals["default/db-0"] = 3
    s = sched(c, evict_timeout_s=10)
    acts = SchedulerActivities(s)
    heartbeats: list = []
    env = ActivityEnvironment()
    env.on_heartbeat = lambda *d: heartbeats.append(d[0])
    r = await env.run(acts.drain_node, DrainRequest("c1", "gpu-004", "xid_48 incident inc-4", "inc-4"))
    assert r.owned and r.state == "drained"
    assert [e["key"] for e in c.evictions] == ["default/db-0"] * 4
    assert c.pods() == []
    assert any(h.get("phase") == "evicting" and h.get("blocked") == ["default/db-0"] for h in heartbeats)


async def test_pdb_429_past_the_deadline_leaves_the_node_draining(cluster: Cluster) -> None:
    c = cluster
    c.node("gpu-005")
    c.pod("default", "quorum-0", "gpu-005")
    c.pod("default", "train-0", "gpu-005")
    c.budget_refusals["default/quorum-0"] = -1
    s = sched(c, evict_timeout_s=0.3)
    r = await s.drain("gpu-005", "xid_79 incident inc-5", "inc-5")
    assert r.drained and r.owned and r.state == "draining"
    assert "default/quorum-0 (Cannot evict pod as it would violate the pod's disruption budget.)" in r.detail
    assert c.pods() == ["default/quorum-0"]
    assert await s.state("gpu-005") == "draining"
    # The budget frees up; a retried drain carries on and finishes.
    c.budget_refusals["default/quorum-0"] = 0
    r = await s.drain("gpu-005", "xid_79 incident inc-5", "inc-5")
    assert r.state == "drained" and c.pods() == []


async def test_conflict_409_is_reread_and_retried(cluster: Cluster) -> None:
    c = cluster
    c.node("gpu-006")
    c.fail_next_patch_409 = 1
    s = sched(c)
    r = await s.drain("gpu-006", "nvlink incident inc-6", "inc-6")
    assert r.owned and s.patch_calls >= 2
    c.fail_next_patch_409 = 99
    c.node("gpu-007")
    with pytest.raises(SchedulerError, match="kept changing under us"):
        await s.drain("gpu-007", "nvlink incident inc-7", "inc-7")


async def test_unknown_node_and_unreachable_api(cluster: Cluster) -> None:
    s = sched(cluster)
    with pytest.raises(NodeNotFoundError, match="'ghost' not found by the API server"):
        await s.drain("ghost", "x incident i", "i")
    acts = SchedulerActivities(s)
    from temporalio.exceptions import ApplicationError

    with pytest.raises(ApplicationError) as ei:
        await ActivityEnvironment().run(acts.drain_node, DrainRequest("c1", "ghost", "x", "i"))
    assert ei.value.type == "NodeNotFound" and ei.value.non_retryable

    from fleetmend.dev import servers

    dead = KubernetesScheduler(KubernetesSettings(api_url=f"http://127.0.0.1:{servers.free_port()}",
                                                  request_timeout_s=2))
    with pytest.raises(SchedulerError, match="unreachable or too slow"):
        await dead.state("gpu-001")


async def test_list_nodes_and_build_scheduler(cluster: Cluster) -> None:
    c = cluster
    c.node("a-1")
    c.node("a-2", unschedulable=True)
    s = build_scheduler(Settings(scheduler="kubernetes", kubernetes={"api_url": c.url}))
    assert isinstance(s, KubernetesScheduler)
    await s.drain("a-1", "xid_79 incident inc-9", "inc-9")
    rows = [(r.name, r.state, r.owner, r.incident_id) for r in await s.list_nodes()]
    assert rows == [("a-1", "cordoned", "fleetmend", "inc-9"), ("a-2", "cordoned", "operator", None)]
    assert c.read(NODES, "a-1")["spec"]["unschedulable"] is True


def test_evictable_rules() -> None:
    from kubernetes import client as k

    def pod(**md) -> object:
        return k.V1Pod(metadata=k.V1ObjectMeta(name="p", namespace="n", **md), status=k.V1PodStatus(phase="Running"))

    assert evictable(pod()) == (True, "")
    assert evictable(pod(annotations={"kubernetes.io/config.mirror": "x"})) == (False, "mirror")
    ds = k.V1OwnerReference(api_version="apps/v1", kind="DaemonSet", name="d", uid="u", controller=True)
    assert evictable(pod(owner_references=[ds])) == (False, "daemonset")


async def test_a_node_labelled_drain_false_is_never_drained(cluster: Cluster) -> None:
    c = cluster
    c.node("gpu-010")
    c.pristine["gpu-010"]["metadata"]["labels"]["fleetmend.io/drain"] = "false"
    c.k8s.objects[NODES, None, "gpu-010"] = c.pristine["gpu-010"]
    c.pod("ml", "train-0", "gpu-010")
    s = sched(c)
    r = await s.drain("gpu-010", "xid_79 incident inc-10", "inc-10")
    assert (r.drained, r.owned, r.operator_drained) == (False, False, False)
    assert "opts out" in r.detail and "fleetmend.io/drain=false" in r.detail
    n = c.read(NODES, "gpu-010")
    assert not n["spec"].get("unschedulable") and not n["spec"].get("taints")
    assert not any(k.startswith("fleetmend.io/") for k in n["metadata"].get("annotations") or {})
    assert c.evictions == [] and "ml/train-0" in c.pods() and s.patch_calls == 0
    # any other value of the label, or none, drains as usual
    c.pristine["gpu-010"]["metadata"]["labels"]["fleetmend.io/drain"] = "true"
    c.k8s.objects[NODES, None, "gpu-010"] = c.pristine["gpu-010"]
    assert (await s.drain("gpu-010", "xid_79 incident inc-10", "inc-10")).drained


async def test_pods_of_system_namespaces_are_never_evicted(cluster: Cluster) -> None:
    c = cluster
    c.node("gpu-011")
    c.pod("kube-system", "coredns-abc", "gpu-011")
    c.pod("fleetmend", "fleetmend-worker-1", "gpu-011")
    c.pod("ml", "train-0", "gpu-011")
    s = sched(c, skip_namespaces=["kube-system", "fleetmend"])
    r = await s.drain("gpu-011", "xid_79 incident inc-11", "inc-11")
    assert r.drained and r.state == "drained", r.detail  # the skipped pods do not keep it draining
    assert [e["key"] for e in c.evictions] == ["ml/train-0"]
    assert {"kube-system/coredns-abc", "fleetmend/fleetmend-worker-1"} <= set(c.pods())
    assert await s.state("gpu-011") == "drained"
