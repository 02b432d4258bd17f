"""Kubernetes scheduler adapter: cordon, taint, annotate and evict through the official client.

What a drain does (`KubernetesScheduler.drain`), in documented API calls only:

1. `GET /api/v1/nodes/{node}` (read_node).
2. One JSON merge patch (`PATCH /api/v1/nodes/{node}`, `application/merge-patch+json`) that sets
   `spec.unschedulable: true` (cordon), appends the NoSchedule taint `fleetmend.io/fault=<fault class>`
   to `spec.taints` and writes the ownership annotations below. The patch carries
   `metadata.resourceVersion` as a precondition, so a concurrent writer gets a 409 Conflict and the
   adapter re-reads and tries again (5 times) instead of overwriting someone else's taints.
3. For every pod bound to the node (`GET /api/v1/pods?fieldSelector=spec.nodeName=<node>`; the
   result is filtered again client-side) that `kubectl drain` would evict — not DaemonSet pods, not
   mirror (static) pods, not pods that already finished — `POST .../pods/{pod}/eviction` with a
   `policy/v1` Eviction. A 429 (a PodDisruptionBudget forbids it now) is retried every
   `evict_retry_s` until `evict_timeout_s`, heartbeating when inside an activity; 404 means the pod
   is gone already. Pods still blocked at the deadline are listed in the result (state `draining`):
   the node stays cordoned and tainted, and a retried activity carries on evicting.

Ownership (annotations on the Node, prefix `KubernetesSettings.annotation_prefix`):
- `fleetmend.io/cordon-owner`: `fleetmend` when this adapter set `spec.unschedulable`, `operator` when
  the node was already cordoned by someone else when fleetmend came (never uncordoned by fleetmend).
- `fleetmend.io/incident`, `fleetmend.io/reason`, `fleetmend.io/drained-at`.
Two things a drain never touches: a Node labelled `<kubernetes.opt_out_label>=false`
(`fleetmend.io/drain=false`: no cordon, taint or eviction; the drain result and a Warning Event say
so, the incident goes on without a drain) and pods in `kubernetes.skip_namespaces` (`kube-system`;
the Helm chart adds fleetmend's own namespace, so a drain never evicts fleetmend's worker or router).

`undrain` removes only what fleetmend added: its taint, its annotations and — only when the
cordon is fleetmend's — `spec.unschedulable`. Operators' taints and annotations are never touched.
An undrain by another incident than the one in `fleetmend.io/incident` changes nothing.

Node condition and Events (node-problem-detector conventions, so medik8s NodeHealthCheck,
dashboards and `kubectl describe node` see them):
- While a drained fault is open the Node carries the condition `FleetmendFault` (`CONDITION_TYPE`)
  with status `True`, reason = the fault class in CamelCase (`xid_79_fallen_off_bus` →
  `Xid79FallenOffBus`), message = the drain reason, `lastHeartbeatTime` = the last write and
  `lastTransitionTime` = when the status last changed. The return to service sets it `False`,
  reason `FleetmendReturned`. Written with `PATCH /api/v1/nodes/{node}/status` (patch_node_status): one
  JSON merge patch holding the whole `status.conditions` list (the kubelet's conditions copied as
  read) with `metadata.resourceVersion` as a precondition, retried on 409 like the node patches.
- core/v1 Events on the Node (`POST /api/v1/namespaces/default/events`, create_namespaced_event;
  `involvedObject` kind Node, uid = the node name, as the kubelet's own node events) for drain,
  diagnostics, ticket and return; reasons in `EVENT_REASONS`. Event names are derived from the
  incident and step, so a retried activity does not record an event twice (409 AlreadyExists is
  success).
Both are best effort: a refusal (RBAC, API server away) is logged and never fails a drain or undrain.

The official client is synchronous: each call runs in a worker thread (`asyncio.to_thread`) and is
bounded by `_request_timeout=request_timeout_s` (a thread cannot be cancelled; the timeout ends it).

Tested against kmock's `KubernetesEmulator` (tests/test_kubernetes_adapter.py). What the emulator
cannot check: label and field selectors are ignored (hence the client-side filter), there is no
`resourceVersion` (so the 409 precondition path is exercised only by a scripted 409), patches are
plain dict merges (no strategic merge; this adapter only uses JSON merge patch, whose list
replacement semantics the emulator does match), there is no Eviction subresource and no
PodDisruptionBudget enforcement (the tests script the eviction endpoint: 429 from a "budget",
then 201 deleting the pod), and no RBAC (the Helm chart's templates/rbac.yaml grants exactly the
verbs used here: nodes get/list/patch, nodes/status patch, pods list, pods/eviction create, events
create).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import structlog
from kubernetes import client as k8s
from kubernetes import config as kconfig
from temporalio import activity
from tenacity import AsyncRetrying, retry_if_result, wait_fixed

from fleetmend.config import KubernetesSettings
from fleetmend.errors import ConfigError, NodeNotFoundError, SchedulerError
from fleetmend.infra.retry import LostRace, until_won
from fleetmend.messages import OWNER_FLEETMEND, OWNER_OPERATOR, DrainResult, NodeInfo, UndrainResult

MERGE_PATCH = "application/merge-patch+json"
CONFLICT_TRIES = 5
"""Re-read and re-patch this many times on 409 Conflict (another writer changed the Node)."""

CONDITION_TYPE = "FleetmendFault"
"""Node condition type of an open fleetmend fault (NodeHealthCheck: `unhealthyConditions` type
FleetmendFault, status True)."""
EVENTS_NAMESPACE = "default"
"""Namespace of Node events (where the kubelet records them; `kubectl describe node` looks there)."""
EVENT_REASONS = {"drained": "FleetmendDrained", "diagnostics": "FleetmendDiagnostics",
                 "ticket": "FleetmendTicketFiled", "returned": "FleetmendReturned"}
"""Event reason per remediation step."""

JOB_LABELS = ("batch.kubernetes.io/job-name", "job-name", "training.kubeflow.org/job-name",
              "jobset.sigs.k8s.io/jobset-name", "leaderworkerset.sigs.k8s.io/name", "volcano.sh/job-name")
"""Pod labels that name the job a pod belongs to (`running_jobs`), the first present wins: a batch/v1
Job's, Kubeflow's training operator's, a JobSet's, a LeaderWorkerSet's, a Volcano job's."""

STATE_READY, STATE_NOT_READY = "ready", "not_ready"
STATE_DRAINING, STATE_DRAINED, STATE_CORDONED = "draining", "drained", "cordoned"


def taint_value(reason: str) -> str:
    """The fault class for the taint value: the reason's first word, made a valid label value.

    `"xid_79_fallen_off_bus incident i-1"` → `"xid_79_fallen_off_bus"`; label values allow
    `[A-Za-z0-9_.-]`, at most 63 characters, starting and ending alphanumeric (Kubernetes API
    conventions, "Syntax and character set" of labels).
    """
    word = (reason.split() or ["fault"])[0]
    value = re.sub(r"[^A-Za-z0-9_.-]", "_", word)[:63].strip("_.-")
    return value or "fault"


def condition_reason(fault_class: str) -> str:
    """A node condition reason in the node-problem-detector style: CamelCase, `[A-Za-z0-9]`, ≤ 128.

    `"xid_79_fallen_off_bus incident remediate/p/n/r"` → `"Xid79FallenOffBus"` (the first word is the
    fault class); an empty class gives `"FleetmendFault"`.
    """
    word = (fault_class.split() or [""])[0]
    parts = [p for p in re.split(r"[^A-Za-z0-9]+", word) if p]
    return ("".join(p[:1].upper() + p[1:] for p in parts) or CONDITION_TYPE)[:128]


def _event_name(node: str, key: str) -> str:
    """`<node>.<16 hex>`: a valid Event name (DNS subdomain ≤ 253) unique per (node, key)."""
    return f"{node[:200]}.{hashlib.sha256(f'{node}|{key}'.encode()).hexdigest()[:16]}"


@dataclass
class EvictionReport:
    evicted: list[str] = field(default_factory=list)
    """`namespace/name` of pods evicted by this call."""
    gone: list[str] = field(default_factory=list)
    """Pods that vanished before their eviction (404)."""
    blocked: dict[str, str] = field(default_factory=dict)
    """Pods still there at the deadline → the last refusal (429 budget message, …)."""
    skipped: list[str] = field(default_factory=list)
    """DaemonSet and mirror pods, which drain leaves (as `kubectl drain --ignore-daemonsets`)."""


def evictable(pod: Any) -> tuple[bool, str]:
    """Would `kubectl drain --ignore-daemonsets --delete-emptydir-data` evict `pod`?

    Returns:
        (True, "") or (False, why): "daemonset", "mirror", "finished".
    """
    md = pod.metadata
    if (md.annotations or {}).get("kubernetes.io/config.mirror"):
        return False, "mirror"
    for ref in md.owner_references or []:
        if ref.kind == "DaemonSet" and ref.controller:
            return False, "daemonset"
    phase = pod.status.phase if pod.status else None
    if phase in ("Succeeded", "Failed"):
        return False, "finished"
    return True, ""


def _heartbeat(details: dict[str, Any]) -> None:
    """Heartbeat when running inside a Temporal activity; a no-op elsewhere (CLI, tests)."""
    if activity.in_activity():
        activity.heartbeat(details)


class KubernetesScheduler:
    """Drain/undrain Kubernetes Nodes (see module docstring for the exact API calls).

    Args:
        settings: `KubernetesSettings` (kubeconfig/context/in-cluster or `api_url`, taint key,
            annotation prefix, eviction deadline).
        api_client: a ready `kubernetes.client.ApiClient` (tests, embedding); None builds one from
            `settings`.
    Raises:
        ConfigError: no kubeconfig and not in a cluster.
    """

    name = "kubernetes"

    def __init__(self, settings: KubernetesSettings, api_client: Any = None) -> None:
        self.s = settings
        self.k8s = k8s
        self.api_client = api_client or self._build_client()
        self.core = k8s.CoreV1Api(self.api_client)
        p = settings.annotation_prefix.rstrip("/")
        self.ann_owner, self.ann_incident = f"{p}/cordon-owner", f"{p}/incident"
        self.ann_reason, self.ann_at = f"{p}/reason", f"{p}/drained-at"
        self.patch_calls = 0
        """Node patches this instance sent (visible idempotency in tests)."""

    def _build_client(self) -> Any:
        cfg = self.k8s.Configuration()
        try:
            if self.s.api_url:
                cfg.host = self.s.api_url.rstrip("/")
            elif self.s.in_cluster or (self.s.in_cluster is None and os.environ.get("KUBERNETES_SERVICE_HOST")):
                kconfig.load_incluster_config(client_configuration=cfg)
            else:
                kconfig.load_kube_config(config_file=str(self.s.kubeconfig) if self.s.kubeconfig else None,
                                         context=self.s.context, client_configuration=cfg)
        except kconfig.ConfigException as err:
            raise ConfigError(
                f"scheduler kubernetes: no API server configuration ({err}); set kubernetes.kubeconfig "
                "(FLEETMEND_KUBERNETES__KUBECONFIG), run in a pod with a service account, or set "
                "kubernetes.api_url") from err
        return self.k8s.ApiClient(cfg)

    @property
    def where(self) -> str:
        return self.api_client.configuration.host

    # -- API plumbing --------------------------------------------------------------------------

    async def _call(self, what: str, fn: Any, *args: Any, node: str | None = None, **kw: Any) -> Any:
        """Run one client call in a thread; map errors to SchedulerError / NodeNotFoundError."""
        kw.setdefault("_request_timeout", self.s.request_timeout_s)
        try:
            return await asyncio.to_thread(fn, *args, **kw)
        except self.k8s.ApiException as err:
            if err.status == 404 and node is not None:
                raise NodeNotFoundError(f"node {node!r} not found by the API server at {self.where}") from err
            if err.status in (401, 403):
                raise SchedulerError(
                    f"{what}: {err.status} {err.reason} from {self.where}; the service account needs "
                    "nodes get/list/patch, nodes/status patch, pods list, pods/eviction create, events create "
                    "(the Helm chart's templates/rbac.yaml)") from err
            raise
        except Exception as err:
            raise SchedulerError(f"{what}: API server {self.where} unreachable or too slow "
                                 f"({type(err).__name__}: {err}); check kubernetes.kubeconfig / api_url") from err

    async def _read(self, node: str) -> Any:
        return await self._call(f"read node {node}", self.core.read_node, node, node=node)

    async def _patch(self, node: str, body: dict[str, Any]) -> Any:
        self.patch_calls += 1
        return await self._call(f"patch node {node}", self.core.patch_node, node, body, node=node,
                                _content_type=MERGE_PATCH)

    def _ours(self, taint: Any) -> bool:
        return taint.key == self.s.taint_key and taint.effect == "NoSchedule"

    @staticmethod
    def _taint_dict(t: Any) -> dict[str, Any]:
        d = {"key": t.key, "effect": t.effect}
        if t.value is not None:
            d["value"] = t.value
        if getattr(t, "time_added", None) is not None:
            d["timeAdded"] = t.time_added.isoformat() if hasattr(t.time_added, "isoformat") else t.time_added
        return d

    def _annotations(self, n: Any) -> dict[str, str]:
        return dict(n.metadata.annotations or {})

    @staticmethod
    def _ready(n: Any) -> bool:
        for c in (n.status.conditions if n.status else None) or []:
            if c.type == "Ready":
                return c.status == "True"
        return False

    async def _pods_on(self, node: str) -> list[Any]:
        """Pods bound to `node` (field selector, then filtered again: emulators ignore selectors)."""
        res = await self._call(f"list pods on {node}", self.core.list_pod_for_all_namespaces,
                               field_selector=f"spec.nodeName={node}")
        return [p for p in res.items if p.spec and p.spec.node_name == node]

    def _evictable(self, pod: Any) -> tuple[bool, str]:
        """`evictable(pod)`, and never a pod of `skip_namespaces` ("system namespace")."""
        if pod.metadata.namespace in self.s.skip_namespaces:
            return False, "system namespace"
        return evictable(pod)

    def opted_out(self, n: Any) -> bool:
        """The Node carries `<opt_out_label>=false`: fleetmend never drains it."""
        return str((n.metadata.labels or {}).get(self.s.opt_out_label, "")).lower() == "false"

    async def _remaining(self, node: str) -> list[Any]:
        return [p for p in await self._pods_on(node) if self._evictable(p)[0]]

    # -- adapter API ---------------------------------------------------------------------------

    async def state(self, node: str) -> str:
        """`ready` / `not_ready` (schedulable), `draining` (cordoned, evictable pods left) or `drained`.

        Raises:
            NodeNotFoundError, SchedulerError.
        """
        n = await self._read(node)
        if not (n.spec and n.spec.unschedulable):
            return STATE_READY if self._ready(n) else STATE_NOT_READY
        return STATE_DRAINING if await self._remaining(node) else STATE_DRAINED

    async def drain(self, node: str, reason: str, incident_id: str) -> DrainResult:
        """Cordon, taint and annotate `node`, then evict its pods (PDB-respecting, with a deadline).

        Args:
            node: Node name.
            reason: `"<fault class> incident <id>"`; the first word becomes the taint value.
            incident_id: recorded in the `incident` annotation.
        Returns:
            `DrainResult` with the Slurm adapter's semantics: already cordoned by fleetmend → owned=True
            (evictions carry on); cordoned by someone else → operator_drained=True, owned=False (the
            fault taint and annotations are added, the cordon is recorded as the operator's and pods
            are left alone). `state` is `drained`, or `draining` when pods remain (listed in `detail`).
            A Node labelled `<opt_out_label>=false` is left as it is: drained=False, detail says so (a
            Warning Event records it); pods of `skip_namespaces` are never evicted.
        Raises:
            NodeNotFoundError: no such Node.
            SchedulerError: API errors, RBAC refusals, or 409 conflicts 5 times in a row.
        """
        async def mark() -> DrainResult | None:
            """One compare-and-set round: cordon, taint and annotate (None), or the opted-out answer."""
            n = await self._read(node)
            ann = self._annotations(n)
            cordoned = bool(n.spec and n.spec.unschedulable)
            if self.opted_out(n) and ann.get(self.ann_owner) != OWNER_FLEETMEND:
                await self.record_event(node, "drained", f"fleetmend did not drain ({reason}): the node opts out "
                                        f"with {self.s.opt_out_label}=false", key=f"{incident_id}|opted-out",
                                        warning=True)
                state = STATE_CORDONED if cordoned else (STATE_READY if self._ready(n) else STATE_NOT_READY)
                return DrainResult(node, False, False, False, state,
                                   f"not drained: the node opts out of fleetmend drains ({self.s.opt_out_label}="
                                   "false); no cordon, taint or eviction", raw_state="opted-out")
            taints = list((n.spec.taints if n.spec else None) or [])
            has_taint = any(self._ours(t) for t in taints)
            owner = ann.get(self.ann_owner)
            if cordoned and owner == OWNER_FLEETMEND and has_taint and ann.get(self.ann_incident) == incident_id:
                return None  # ours already: carry on with evictions (an activity retry lands here)
            # A fleetmend drain of an earlier incident of this node (that incident is over: one incident
            # per node runs at a time) is adopted below: the incident annotation becomes this one's.
            if cordoned and owner == OWNER_OPERATOR and has_taint:
                return None  # an operator's cordon, already marked
            owner = OWNER_OPERATOR if cordoned and owner != OWNER_FLEETMEND else OWNER_FLEETMEND
            new_taints = [self._taint_dict(t) for t in taints if not self._ours(t)]
            new_taints.append({"key": self.s.taint_key, "value": taint_value(reason), "effect": "NoSchedule"})
            body: dict[str, Any] = {
                "metadata": {"annotations": {
                    self.ann_owner: owner, self.ann_incident: incident_id, self.ann_reason: reason[:1000],
                    self.ann_at: datetime.now(timezone.utc).isoformat(timespec="seconds")}},
                "spec": {"taints": new_taints},
            }
            if n.metadata.resource_version:
                body["metadata"]["resourceVersion"] = n.metadata.resource_version
            if owner == OWNER_FLEETMEND:
                body["spec"]["unschedulable"] = True
            try:
                await self._patch(node, body)
            except self.k8s.ApiException as err:
                if err.status == 409:
                    raise LostRace(node) from None
                raise SchedulerError(f"patch node {node} at {self.where}: {err.status} {err.reason}: "
                                     f"{(err.body or '')[:300]}") from err
            return None

        try:
            opted_out = await until_won(mark, attempts=CONFLICT_TRIES)  # tenacity: fleetmend.infra.retry
        except LostRace:
            raise SchedulerError(f"drain of {node}: the Node kept changing under us ({CONFLICT_TRIES} 409s)") \
                from None
        if opted_out is not None:
            return opted_out

        n = await self._read(node)
        ann = self._annotations(n)
        await self.set_condition(node, True, condition_reason(reason), reason)
        await self.record_event(node, "drained", f"fleetmend drain: {reason}", key=f"{incident_id}|drained",
                                warning=True)
        if ann.get(self.ann_owner) != OWNER_FLEETMEND:
            return DrainResult(node, True, False, True, STATE_CORDONED,
                               f"already cordoned by someone else; fault taint {self.s.taint_key} added, "
                               "cordon recorded as the operator's and never lifted by fleetmend; pods left as is",
                               reason=ann.get(self.ann_reason, ""), raw_state="unschedulable")
        rep = await self.evict_pods(node)
        state = STATE_DRAINING if rep.blocked else STATE_DRAINED
        detail = (f"cordoned, tainted {self.s.taint_key}={taint_value(reason)}; evicted {len(rep.evicted)}, "
                  f"gone {len(rep.gone)}, left {len(rep.skipped)} daemonset/mirror pod(s)")
        if rep.blocked:
            detail += "; still running at the eviction deadline: " + ", ".join(
                f"{k} ({v})" for k, v in sorted(rep.blocked.items()))
        return DrainResult(node, True, True, False, state, detail, reason=ann.get(self.ann_reason, reason),
                           raw_state="unschedulable")

    async def evict_pods(self, node: str, timeout_s: float | None = None) -> EvictionReport:
        """Evict every evictable pod on `node` through the Eviction API; 429s retried until the deadline.

        Args:
            node: Node name.
            timeout_s: overall deadline (default `evict_timeout_s`).
        Returns:
            `EvictionReport` (evicted, gone, blocked with the last refusal, skipped).
        Raises:
            SchedulerError: an eviction failed with anything but 404/429 (e.g. 500 for a pod covered by
                several PodDisruptionBudgets, 403 without RBAC).
        """
        deadline = time.monotonic() + (self.s.evict_timeout_s if timeout_s is None else timeout_s)
        rep = EvictionReport()
        pending: dict[str, Any] = {}
        for p in await self._pods_on(node):
            key = f"{p.metadata.namespace}/{p.metadata.name}"
            ok, why = self._evictable(p)
            if ok:
                pending[key] = p
            else:
                rep.skipped.append(f"{key} ({why})")

        async def one_pass() -> None:
            """Ask the Eviction API once for every pending pod; a 429 leaves the pod pending."""
            for key, p in list(pending.items()):
                body = self.k8s.V1Eviction(
                    api_version="policy/v1", kind="Eviction",
                    metadata=self.k8s.V1ObjectMeta(name=p.metadata.name, namespace=p.metadata.namespace),
                    delete_options=(self.k8s.V1DeleteOptions(grace_period_seconds=self.s.grace_period_s)
                                    if self.s.grace_period_s is not None else None))
                try:
                    await self._call(f"evict {key}", self.core.create_namespaced_pod_eviction,
                                     p.metadata.name, p.metadata.namespace, body)
                    rep.evicted.append(key)
                    del pending[key]
                except self.k8s.ApiException as err:
                    if err.status == 404:
                        rep.gone.append(key)
                        del pending[key]
                    elif err.status == 429:
                        rep.blocked[key] = _status_message(err) or "429 Too Many Requests (disruption budget)"
                    else:
                        raise SchedulerError(f"evict {key} from {node} at {self.where}: {err.status} "
                                             f"{err.reason}: {_status_message(err)}") from err
            for key in rep.evicted + rep.gone:
                rep.blocked.pop(key, None)
            _heartbeat({"phase": "evicting", "node": node, "evicted": len(rep.evicted),
                        "blocked": sorted(pending)})

        if pending:  # a pass every `evict_retry_s` while pods are refused, none that would start past the deadline
            async for attempt in AsyncRetrying(
                    retry=retry_if_result(lambda _none: bool(pending)), wait=wait_fixed(self.s.evict_retry_s),
                    stop=lambda _state: time.monotonic() + self.s.evict_retry_s > deadline,
                    retry_error_callback=lambda _state: None):
                with attempt:
                    await one_pass()
        return rep

    async def undrain(self, node: str, incident_id: str) -> UndrainResult:
        """Remove fleetmend's taint and annotations; uncordon only a cordon fleetmend set.

        Returns:
            `UndrainResult`: resumed=True when fleetmend's cordon was lifted (or its taint removed after an
            operator had already uncordoned); resumed=False with operator_drained=True when the cordon is
            someone else's (fleetmend's marks are removed, the cordon stays); resumed=False when there was
            nothing of fleetmend's on the node.
        Raises:
            NodeNotFoundError, SchedulerError: as `drain`.
        """
        async def one_round() -> UndrainResult:
            n = await self._read(node)
            ann = self._annotations(n)
            cordoned = bool(n.spec and n.spec.unschedulable)
            taints = list((n.spec.taints if n.spec else None) or [])
            has_taint = any(self._ours(t) for t in taints)
            owner = ann.get(self.ann_owner)
            if ann.get(self.ann_incident) not in (None, incident_id):
                return UndrainResult(node, False, STATE_CORDONED if cordoned else STATE_READY,
                                     f"the drain belongs to incident {ann.get(self.ann_incident)}, not {incident_id}; "
                                     "left as is", operator_drained=owner != OWNER_FLEETMEND and cordoned)
            if owner is None and not has_taint:
                if cordoned:
                    return UndrainResult(node, False, STATE_CORDONED, "cordoned by someone else and not marked "
                                         "by fleetmend; left for the operator", operator_drained=True)
                return UndrainResult(node, False, STATE_READY if self._ready(n) else STATE_NOT_READY,
                                     "not cordoned and no fleetmend taint; nothing to resume")
            body: dict[str, Any] = {
                "metadata": {"annotations": {k: None for k in (self.ann_owner, self.ann_incident, self.ann_reason,
                                                                self.ann_at)}},
            }
            if has_taint:
                body["spec"] = {"taints": [self._taint_dict(t) for t in taints if not self._ours(t)]}
            if owner == OWNER_FLEETMEND and cordoned:
                body.setdefault("spec", {})["unschedulable"] = False
            if n.metadata.resource_version:
                body["metadata"]["resourceVersion"] = n.metadata.resource_version
            try:
                await self._patch(node, body)
            except self.k8s.ApiException as err:
                if err.status == 409:
                    raise LostRace(node) from None
                raise SchedulerError(f"patch node {node} at {self.where}: {err.status} {err.reason}") from err
            await self.set_condition(node, False, EVENT_REASONS["returned"], f"returned to service by {incident_id}")
            await self.record_event(node, "returned", f"fleetmend returned the node to service ({incident_id})",
                                    key=f"{incident_id}|returned")
            if owner == OWNER_FLEETMEND:
                what = "uncordoned" if cordoned else "cordon already lifted by someone; fleetmend taint removed"
                return UndrainResult(node, True, STATE_READY, what)
            return UndrainResult(node, False, STATE_CORDONED if cordoned else STATE_READY,
                                 "fleetmend taint and annotations removed; the cordon is the operator's and "
                                 "stays", operator_drained=cordoned)

        try:
            return await until_won(one_round, attempts=CONFLICT_TRIES)  # tenacity: fleetmend.infra.retry
        except LostRace:
            raise SchedulerError(f"undrain of {node}: the Node kept changing under us ({CONFLICT_TRIES} 409s)") \
                from None

    async def set_condition(self, node: str, active: bool, reason: str, message: str) -> bool:
        """Set the Node's `FleetmendFault` condition (see module docstring); best effort.

        Args:
            node: Node name.
            active: True while the fault is open (status "True"), False once returned ("False").
            reason: CamelCase reason (`condition_reason`).
            message: human-readable, truncated to 1024 characters.
        Returns:
            True when written, False when refused or unreachable (logged).
        """
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        status = "True" if active else "False"

        async def one_round() -> bool:
            try:
                n = await self._read(node)
            except (NodeNotFoundError, SchedulerError) as err:
                _log().warning("node_condition_failed", node=node, error=str(err))
                return False
            conds = []
            mine = None
            for c in (n.status.conditions if n.status else None) or []:
                d = self.api_client.sanitize_for_serialization(c)
                if d.get("type") == CONDITION_TYPE:
                    mine = d
                else:
                    conds.append(d)
            if mine is None and not active:
                return True  # never set: nothing to clear
            transition = _rfc3339(mine.get("lastTransitionTime")) if mine and mine.get("status") == status else None
            conds.append({"type": CONDITION_TYPE, "status": status, "reason": reason, "message": message[:1024],
                          "lastHeartbeatTime": now, "lastTransitionTime": transition or now})
            body: dict[str, Any] = {"status": {"conditions": conds}}
            if n.metadata.resource_version:
                body["metadata"] = {"resourceVersion": n.metadata.resource_version}
            try:
                await self._call(f"patch node {node} status", self.core.patch_node_status, node, body, node=node,
                                 _content_type=MERGE_PATCH)
                return True
            except self.k8s.ApiException as err:
                if err.status == 409:
                    raise LostRace(node) from None
                _log().warning("node_condition_failed", node=node, status=err.status, error=_status_message(err))
                return False
            except (NodeNotFoundError, SchedulerError) as err:
                _log().warning("node_condition_failed", node=node, error=str(err))
                return False

        try:
            return await until_won(one_round, attempts=CONFLICT_TRIES)  # tenacity: fleetmend.infra.retry
        except LostRace:
            _log().warning("node_condition_failed", node=node, error=f"{CONFLICT_TRIES} conflicts in a row")
            return False

    async def record_event(self, node: str, step: str, message: str, *, key: str, warning: bool = False) -> bool:
        """Record a core/v1 Event on the Node for a remediation `step` (a key of `EVENT_REASONS`).

        Args:
            key: identifies this occurrence (incident id and step); the same key records one Event.
            warning: type Warning (drain) instead of Normal.
        Returns:
            True when recorded (or already recorded), False when refused or unreachable (logged).
        Raises:
            KeyError: an unknown step.
        """
        reason = EVENT_REASONS[step]
        now = datetime.now(timezone.utc)
        k = self.k8s
        ev = k.CoreV1Event(
            metadata=k.V1ObjectMeta(name=_event_name(node, key), namespace=EVENTS_NAMESPACE),
            involved_object=k.V1ObjectReference(api_version="v1", kind="Node", name=node, uid=node),
            reason=reason, message=message[:1024], type="Warning" if warning else "Normal",
            source=k.V1EventSource(component="fleetmend"), reporting_component="fleetmend",
            reporting_instance="fleetmend-worker", first_timestamp=now, last_timestamp=now, count=1)
        try:
            await self._call(f"record event on {node}", self.core.create_namespaced_event, EVENTS_NAMESPACE, ev)
            return True
        except self.k8s.ApiException as err:
            if err.status == 409:
                return True
            _log().warning("node_event_failed", node=node, reason=reason, status=err.status,
                           error=_status_message(err))
        except SchedulerError as err:
            _log().warning("node_event_failed", node=node, reason=reason, error=str(err))
        return False

    async def running_jobs(self) -> dict[str, list[str]]:
        """`<namespace>/<job>` → the nodes its running pods are bound to, the job named by the first of
        `JOB_LABELS` a pod carries (one pod list per label, `labelSelector=<label>`, filtered again
        client-side): the fail-slow analyzer compares the nodes of one job together, whether or not
        every rank reports its step times (`fleetmend.worker.analyzer_link`).

        Raises:
            SchedulerError: the API server refused or is away."""
        jobs: dict[str, set[str]] = {}
        seen: set[tuple[str, str]] = set()
        for label in JOB_LABELS:
            res = await self._call(f"list pods labelled {label}", self.core.list_pod_for_all_namespaces,
                                   label_selector=label)
            for p in res.items:
                md = p.metadata
                key = (md.namespace or "", md.name or "")
                labels = md.labels or {}
                name = next((labels[k] for k in JOB_LABELS if labels.get(k)), None)
                if key in seen or name is None or not (p.spec and p.spec.node_name) or \
                        not (p.status and p.status.phase == "Running"):
                    continue
                seen.add(key)
                jobs.setdefault(f"{md.namespace}/{name}", set()).add(p.spec.node_name)
        return {job: sorted(nodes) for job, nodes in jobs.items()}

    async def list_nodes(self) -> list[NodeInfo]:
        """Every Node with its state, fleetmend reason, owner of the cordon and incident.

        Owner is `fleetmend` or `operator` for a cordoned node, None when schedulable. The state of a
        cordoned node is `cordoned` here (listing every node's pods would be a fleet-wide pod list).
        """
        res = await self._call("list nodes", self.core.list_node)
        rows = []
        for n in sorted(res.items, key=lambda n: n.metadata.name):
            ann = self._annotations(n)
            cordoned = bool(n.spec and n.spec.unschedulable)
            owner = ann.get(self.ann_owner) or (OWNER_OPERATOR if cordoned else None)
            if not cordoned and owner == OWNER_OPERATOR:
                owner = None
            state = STATE_CORDONED if cordoned else (STATE_READY if self._ready(n) else STATE_NOT_READY)
            rows.append(NodeInfo(n.metadata.name, state, ann.get(self.ann_reason, ""), owner,
                                 ann.get(self.ann_incident)))
        return rows


def _rfc3339(v: Any) -> str | None:
    """`2026-11-30T18:07:28Z` from a datetime or any ISO 8601 string (None stays None)."""
    if not v:
        return None
    at = v if isinstance(v, datetime) else datetime.fromisoformat(str(v).replace("Z", "+00:00"))
    return at.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _log() -> Any:
    return structlog.get_logger("fleetmend.kubernetes")


def _status_message(err: Any) -> str:
    """The `message` of a Kubernetes `Status` error body, else the raw body (truncated)."""
    try:
        return str(json.loads(err.body or "{}").get("message", ""))[:300]
    except (ValueError, AttributeError):
        return str(err.body or "")[:300]
