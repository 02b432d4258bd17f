"""The Helm chart `deploy/helm/fleetmend`, rendered by Helm's own engine (`helm-python-sdk`, a binding
of Helm's Go SDK: the same template functions, value coalescing and hooks as `helm template`), and
every rendered object validated against the Kubernetes OpenAPI schema (`kubernetes-validate`,
strict: unknown fields are errors) of the oldest and newest Kubernetes the chart claims.

No cluster runs here: nothing is applied. The prometheus-operator objects (ServiceMonitor,
PrometheusRule) have no schema in `kubernetes-validate`; their shape and the metric names their
queries use are checked against `fleetmend.infra.metrics` instead."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import helm_python as helm  # dev dependency helm-python-sdk
import kubernetes_validate as kv  # dev dependency kubernetes-validate
import pytest
import yaml

from fleetmend.config import load_settings
from fleetmend.infra import metrics

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy/helm/fleetmend"
GENERATED = ROOT / "deploy/kubernetes/fleetmend.yaml"
K8S_VERSIONS = ("1.25.0", kv.latest_version())
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}

EVERYTHING_ON = {
    "cluster": "eks-a",
    "credentials": {"servicesSecret": "fleetmend-nats", "agentsSecret": "fleetmend-nats-nodes",
                    "workerEnvSecret": "fleetmend-tickets"},
    "monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "kps"}},
                   "prometheusRule": {"enabled": True}},
    "worker": {"stateClaim": "fleetmend-state"},
    "tickets": {"kind": "jira", "jira": {"url": "https://jira.example.com", "project": "GPU"}},
    "agent": {"privileged": False},
}


def render(values: dict | None = None, namespace: str = "fleetmend") -> list[dict[str, Any]]:
    chart = helm.Chart.load(str(CHART))
    out = chart.render(values or {}, name="fleetmend", namespace=namespace, is_install=True)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith(".txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


@pytest.fixture(scope="module")
def default_docs() -> list[dict]:
    return render()


@pytest.fixture(scope="module")
def full_docs() -> list[dict]:
    return render(EVERYTHING_ON)


def test_lint_is_clean() -> None:
    report = helm.lint(str(CHART), strict=True)
    assert not report["errors"], report
    assert all(m["severity"] < 2 for m in report["messages"]), report["messages"]


EVERY_NEW_VALUE = {
    "fullnameOverride": "fm", "nameOverride": "fleet",
    "image": {"digest": "sha256:" + "a" * 64},
    "podLabels": {"team": "gpu-ops"}, "podAnnotations": {"example.com/owner": "gpu-ops"},
    "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/fm"}},
    "nats": {"tls": {"enabled": True, "secretName": "nats-client-tls", "mutual": True, "serverName": "nats"}},
    "temporal": {"tls": {"enabled": True, "secretName": "temporal-client-tls"},
                 "setup": {"extraEnv": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}],
                           "extraVolumes": [{"name": "ca", "configMap": {"name": "corp-ca"}}],
                           "extraVolumeMounts": [{"name": "ca", "mountPath": "/etc/corp-ca"}]}},
    "agent": {"extraVolumes": [{"name": "ca", "configMap": {"name": "corp-ca"}}],
              "extraVolumeMounts": [{"name": "ca", "mountPath": "/etc/corp-ca"}],
              "podAnnotations": {"a": "b"}, "updateStrategy": {"type": "OnDelete"}},
    "worker": {"priorityClassName": "system-cluster-critical", "strategy": {"type": "Recreate"},
               "extraVolumes": [{"name": "ca", "configMap": {"name": "corp-ca"}}],
               "extraVolumeMounts": [{"name": "ca", "mountPath": "/etc/corp-ca"}], "podLabels": {"w": "1"}},
    "router": {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                              "whenUnsatisfiable": "DoNotSchedule",
                                              "labelSelector": {"matchLabels": {"app.kubernetes.io/component":
                                                                                "router"}}}]},
    "analyzer": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["system"]}]}]}}}},
    "networkPolicy": {"enabled": True, "metricsFrom": [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}]},
    "grafana": {"dashboard": {"enabled": True, "namespace": "monitoring"}},
}


@pytest.mark.parametrize("values", [{}, EVERYTHING_ON, {"analyzer": {"enabled": False}, "scheduler": "standalone",
                                                        "agent": {"runtimeClassName": ""}}, EVERY_NEW_VALUE],
                         ids=["defaults", "everything-on", "standalone-no-analyzer", "every-new-value"])
def test_every_rendered_object_matches_the_kubernetes_schema(values: dict) -> None:
    docs = render(values)
    assert len(docs) >= 12
    for d in docs:
        if d["kind"] in CRD_KINDS:
            continue
        for version in K8S_VERSIONS:
            try:
                kv.validate(d, version, strict=True)
            except kv.ValidationError as err:
                pytest.fail(f"{d['kind']}/{d['metadata']['name']} invalid for Kubernetes {version}: {err.message} "
                            f"at {'.'.join(str(p) for p in err.path)}")


def test_schema_validation_really_rejects_a_broken_object(default_docs: list[dict]) -> None:
    ds = dict(next(iter(by_kind(default_docs, "DaemonSet").values())))
    ds["spec"] = {**ds["spec"], "selector": "app=agent"}
    with pytest.raises(kv.ValidationError):
        kv.validate(ds, K8S_VERSIONS[-1], strict=True)


def test_the_settings_file_is_one_fleetmend_accepts(full_docs: list[dict], tmp_path: Path) -> None:
    cm = by_kind(full_docs, "ConfigMap")["fleetmend-config"]
    f = tmp_path / "fleetmend.toml"
    f.write_text(cm["data"]["fleetmend.toml"])
    s = load_settings(f)
    assert s.scheduler.value == "kubernetes" and s.kubernetes.in_cluster is True
    assert s.tickets.kind.value == "jira" and s.tickets.jira.project == "GPU"
    assert s.policy.max_drained_nodes == 20
    # a typo in a settings section is refused at render time by values.schema.json (fleetmend.config's
    # own field names), no longer only when the pod starts
    with pytest.raises(helm.HelmValuesError, match="max_drained_nodez"):
        render({"policy": {"max_drained_nodez": 3}})


def test_agent_daemonset_has_what_a_gpu_node_needs(full_docs: list[dict]) -> None:
    ds = by_kind(full_docs, "DaemonSet")["fleetmend-agent"]
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["runtimeClassName"] == "nvidia"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all" and "utility" in env["NVIDIA_DRIVER_CAPABILITIES"]["value"]
    assert env["FLEETMEND_CLUSTER"]["value"] == "eks-a"
    assert env["FLEETMEND_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["FLEETMEND_METRICS__AGENT_PORT"]["value"] == "9303"
    assert env["FLEETMEND_NATS_NKEY_SEED"]["value"] == "/etc/fleetmend/nats/$(FLEETMEND_NODE).nk"
    assert env["FLEETMEND_AGENT__MANAGE_STREAM"]["value"] == "false"
    assert c["securityContext"]["runAsUser"] == 0 and c["securityContext"]["capabilities"]["add"] == ["SYSLOG"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["kmsg"]["hostPath"] == {"path": "/dev/kmsg", "type": "CharDevice"}
    assert vols["host-root"]["hostPath"]["path"] == "/" and env["FLEETMEND_AGENT__HOST_ROOT"]["value"] == "/host"
    assert {m["name"]: m for m in c["volumeMounts"]}["host-root"]["readOnly"] is True
    assert vols["nats-creds"]["secret"]["secretName"] == "fleetmend-nats-nodes"
    # GPU workload taints and fleetmend's own fault taint: a keyless Exists toleration matches every taint
    assert {"operator": "Exists"} in pod["tolerations"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert not any(str(r).startswith("nvidia.com/gpu") for r in c["resources"].get("requests", {}))  # no GPU taken
    assert pod["automountServiceAccountToken"] is False
    # privileged by default: the GPU reset needs it
    (dc,) = by_kind(render(), "DaemonSet")["fleetmend-agent"]["spec"]["template"]["spec"]["containers"]
    assert dc["securityContext"]["privileged"] is True


def test_router_worker_analyzer_have_probes_on_their_metrics_ports_and_budgets(full_docs: list[dict]) -> None:
    deps, pdbs = by_kind(full_docs, "Deployment"), by_kind(full_docs, "PodDisruptionBudget")
    assert set(deps) == {"fleetmend-router", "fleetmend-worker", "fleetmend-analyzer"} == set(pdbs)
    ports = {"router": 9301, "worker": 9302, "analyzer": 9304}
    for name, d in deps.items():
        role = name.split("-")[1]
        (c,) = d["spec"]["template"]["spec"]["containers"]
        assert c["ports"] == [{"name": "metrics", "containerPort": ports[role], "protocol": "TCP"}]
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
        assert c["args"] == [role, "--metrics-port", str(ports[role])]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["FLEETMEND_CLUSTER"] == "eks-a" and env["FLEETMEND_CONFIG"] == "/etc/fleetmend/fleetmend.toml"
        assert pdbs[name]["spec"]["selector"] == d["spec"]["selector"]
        assert c["securityContext"]["runAsNonRoot"] is True
    from fleetmend.infra import security

    for role in ("router", "worker"):
        (c,) = deps[f"fleetmend-{role}"]["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["FLEETMEND_NATS_NKEY_SEED"] == f"/etc/fleetmend/nats/{role}.nk"
        assert env["FLEETMEND_NATS_INBOX_PREFIX"] == security.role_inbox_prefix(role)
    worker = deps["fleetmend-worker"]["spec"]["template"]["spec"]
    assert worker["containers"][0]["envFrom"] == [{"secretRef": {"name": "fleetmend-tickets"}}]
    assert {v["name"]: v for v in worker["volumes"]}["state"]["persistentVolumeClaim"]["claimName"] == "fleetmend-state"
    assert "fleetmend-analyzer" not in by_kind(render({"analyzer": {"enabled": False}}), "Deployment")


def test_role_flags_are_ones_the_cli_accepts(default_docs: list[dict]) -> None:
    from typer.testing import CliRunner

    from fleetmend.cli.app import app

    commands = {c.name for c in app.registered_commands}
    for d in by_kind(default_docs, "Deployment").values():
        args = d["spec"]["template"]["spec"]["containers"][0]["args"]
        if args[0] == "analyzer" and "analyzer" not in commands:
            continue  # the analyzer role is not in this build yet; its Deployment is checked once it is
        r = CliRunner().invoke(app, [*args, "--help"])
        assert r.exit_code == 0, (args, r.output)
    job = by_kind(default_docs, "Job")["fleetmend-temporal-setup"]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["temporal", "setup"]
    r = CliRunner().invoke(app, [*args, "--help"])
    assert r.exit_code == 0, r.output


def test_temporal_setup_is_a_hook_job(default_docs: list[dict]) -> None:
    job = by_kind(default_docs, "Job")["fleetmend-temporal-setup"]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert "--address" in job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not by_kind(render({"temporal": {"setup": {"enabled": False}}}), "Job")


NEEDED = {"read_node": ("", "nodes", "get"), "list_node": ("", "nodes", "list"),
          "patch_node": ("", "nodes", "patch"), "patch_node_status": ("", "nodes/status", "patch"),
          "list_pod_for_all_namespaces": ("", "pods", "list"),
          "create_namespaced_pod_eviction": ("", "pods/eviction", "create"),
          "create_namespaced_event": ("", "events", "create")}
"""`CoreV1Api` method → the (API group, resource, verb) it needs."""


def _grants(role: dict) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]}


def test_rbac_grants_exactly_what_the_kubernetes_adapter_calls(default_docs: list[dict]) -> None:
    roles = by_kind(default_docs, "ClusterRole")
    assert set(roles) == {"fleetmend-fleetmend-drainer", "fleetmend-fleetmend-router-drainer"}
    src = "\n".join(p.read_text() for p in ROOT.glob("activities/**/kubernetes*.py"))
    calls = set(re.findall(r"self\.core\.(\w+)", src))
    assert calls <= set(NEEDED), f"the adapter calls {calls - set(NEEDED)}: grant it in rbac.yaml"
    grants = _grants(roles["fleetmend-fleetmend-drainer"])
    assert grants == {NEEDED[c] for c in calls}, grants ^ {NEEDED[c] for c in calls}
    bindings = by_kind(default_docs, "ClusterRoleBinding")
    worker = by_kind(default_docs, "Deployment")["fleetmend-worker"]["spec"]["template"]["spec"]
    assert [s["name"] for s in bindings["fleetmend-fleetmend-drainer"]["subjects"]] == [worker["serviceAccountName"]]
    assert not by_kind(render({"scheduler": "slurm"}), "ClusterRole")


async def test_the_router_has_its_own_account_with_exactly_the_verbs_of_a_drain(default_docs: list[dict]) -> None:
    """The router cordons a must-drain-now fault through `KubernetesScheduler.drain` (issue 24 point 3):
    a drain of a node with a pod to evict, recorded call by call against kmock's emulator, needs
    exactly the router role's grants (no nodes list, nothing else)."""
    import kmock

    from activities.kubernetes import KubernetesScheduler
    from fleetmend.config import KubernetesSettings

    pods, nodes = kmock.resource("", "v1", "pods"), kmock.resource("", "v1", "nodes")
    async with kmock.KubernetesEmulator() as k8s, kmock.Server(k8s) as srv:
        k8s.resources["v1/pods"], k8s.resources["v1/nodes"] = {}, {}

        def evict(request):  # the Eviction subresource kmock lacks: 201 and the pod goes
            del k8s.objects[pods, request.namespace, request.name]
            return kmock.Response(status=201, payload={"kind": "Status", "apiVersion": "v1", "code": 201})

        k8s["post", kmock.subresource("eviction")] << evict
        k8s.objects[nodes, None, "gpu-001"] = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-001"},
                                               "spec": {}, "status": {"conditions": [{"type": "Ready",
                                                                                      "status": "True"}]}}
        k8s.objects[pods, "ml", "train-0"] = {"apiVersion": "v1", "kind": "Pod",
                                              "metadata": {"name": "train-0", "namespace": "ml"},
                                              "spec": {"nodeName": "gpu-001", "containers": [{"name": "c",
                                                                                              "image": "i"}]},
                                              "status": {"phase": "Running"}}
        s = KubernetesScheduler(KubernetesSettings(api_url=str(srv.url).rstrip("/"), evict_retry_s=0.05))
        used: list[str] = []
        real = s.core

        class Recording:
            def __getattr__(self, name: str):
                used.append(name)
                return getattr(real, name)

        s.core = Recording()
        r = await s.drain("gpu-001", "xid_79 incident inc-1", "inc-1")
        assert r.drained and r.owned and "evicted 1" in r.detail
    needed = {NEEDED[c] for c in used}
    assert ("", "nodes", "list") not in needed and ("", "pods/eviction", "create") in needed
    role = by_kind(default_docs, "ClusterRole")["fleetmend-fleetmend-router-drainer"]
    assert _grants(role) == needed, _grants(role) ^ needed
    (binding,) = [b for b in by_kind(default_docs, "ClusterRoleBinding").values()
                  if b["roleRef"]["name"] == role["metadata"]["name"]]
    router = by_kind(default_docs, "Deployment")["fleetmend-router"]["spec"]["template"]["spec"]
    assert router["serviceAccountName"] == "fleetmend-router" in by_kind(default_docs, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "fleetmend-router", "namespace": "fleetmend"}]
    for other in ("slurm", "standalone", "none"):
        docs = render({"scheduler": other})
        spec = by_kind(docs, "Deployment")["fleetmend-router"]["spec"]["template"]["spec"]
        assert "serviceAccountName" not in spec and spec["automountServiceAccountToken"] is False, other
        assert "fleetmend-router" not in by_kind(docs, "ServiceAccount")


def _known_metric_names() -> set[str]:
    from fleetmend.infra import fleetgauges

    known = set()
    for obj in [*vars(metrics).values(), *vars(fleetgauges).values()]:
        if hasattr(obj, "describe") and hasattr(obj, "_name"):
            for fam in obj.describe():
                known |= {fam.name, fam.name + "_total", fam.name + "_bucket", fam.name + "_sum", fam.name + "_count"}
    return known


def test_alerts_and_service_monitor_use_real_metrics(full_docs: list[dict]) -> None:
    (rule,) = by_kind(full_docs, "PrometheusRule").values()
    alerts = {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(alerts) == {"FleetmendBreakerOpen", "FleetmendSpoolGrowing", "FleetmendRouterLag",
                           "FleetmendDeadLetters", "FleetmendAgentsSilent", "FleetmendNoGaugePublisher",
                           "FleetmendGaugesDoubled", "FleetmendDrainsNearBudget", "FleetmendIncidentsAwaitingRepair"}
    assert "fleetmend_fleet_gauges_publisher" in alerts["FleetmendGaugesDoubled"]
    used = {n for e in alerts.values() for n in re.findall(r"\bfleetmend_[a-z_]+", e)}
    assert used <= _known_metric_names(), used - _known_metric_names()
    (sm,) = by_kind(full_docs, "ServiceMonitor").values()
    assert sm["metadata"]["labels"]["release"] == "kps"
    sel = sm["spec"]["selector"]["matchLabels"]
    services = [s for s in by_kind(full_docs, "Service").values()
                if all(s["metadata"]["labels"].get(k) == v for k, v in sel.items())]
    assert {s["metadata"]["name"] for s in services} == {
        "fleetmend-router-metrics", "fleetmend-worker-metrics", "fleetmend-analyzer-metrics", "fleetmend-agent-metrics"}
    assert all(s["spec"]["ports"][0]["name"] == sm["spec"]["endpoints"][0]["port"] for s in services)


def test_a_bad_cluster_name_fails_rendering_with_the_reason() -> None:
    with pytest.raises(helm.HelmError, match="letters, digits"):
        render({"cluster": "prod.east"})


def test_generated_manifests_are_the_chart_rendered() -> None:
    from scripts.render_manifests import render_manifests

    assert GENERATED.read_text() == render_manifests(), \
        "deploy/kubernetes/fleetmend.yaml is stale: run `python -m scripts.render_manifests`"


def test_example_values_for_nats_and_temporal_charts() -> None:
    nats = yaml.safe_load((ROOT / "deploy/helm/examples/nats-values.yaml").read_text())
    assert nats["config"]["jetstream"]["enabled"] is True
    assert nats["config"]["cluster"]["enabled"] is True and nats["config"]["cluster"]["replicas"] == 3
    temporal = yaml.safe_load((ROOT / "deploy/helm/examples/temporal-values.yaml").read_text())
    stores = temporal["server"]["config"]["persistence"]
    assert stores["default"]["sql"]["pluginName"] == "postgres12"
    assert stores["visibility"]["sql"]["pluginName"] == "postgres12"


def test_the_setup_job_sets_the_namespace_retention() -> None:
    def env(docs: list[dict]) -> dict[str, str]:
        (job,) = by_kind(docs, "Job").values()
        return {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}

    assert env(render({}))["FLEETMEND_TEMPORAL_RETENTION_DAYS"] == "90"
    assert env(render({"temporal": {"retentionDays": 400}}))["FLEETMEND_TEMPORAL_RETENTION_DAYS"] == "400"


def test_every_workloads_environment_loads_as_fleetmend_settings(full_docs: list[dict], tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The FLEETMEND_* variables the chart sets (settings reject unknown names) with the ConfigMap as
    FLEETMEND_CONFIG, on a node named like an EKS node."""
    import os

    node = "ip-10-0-1-23.ec2.internal"
    cfg = tmp_path / "fleetmend.toml"
    cfg.write_text(by_kind(full_docs, "ConfigMap")["fleetmend-config"]["data"]["fleetmend.toml"])
    workloads = [*by_kind(full_docs, "DaemonSet").values(), *by_kind(full_docs, "Deployment").values()]
    for w in workloads:
        (c,) = w["spec"]["template"]["spec"]["containers"]
        env: dict[str, str] = {}
        for e in c["env"]:
            if "valueFrom" in e:
                assert e["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
                env[e["name"]] = node
            else:
                env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m, env=env: env[m.group(1)], e["value"])
        env["FLEETMEND_CONFIG"] = str(cfg)
        for k in [k for k in os.environ if k.startswith("FLEETMEND_")]:
            monkeypatch.delenv(k)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        s = load_settings()
        assert s.cluster == "eks-a" and s.nats_url == "nats://nats.nats.svc:4222", w["metadata"]["name"]
        if w["kind"] == "DaemonSet":
            assert s.node == node and s.metrics.agent_port == 9303 and not s.agent.manage_stream
            assert str(s.nats_nkey_seed) == f"/etc/fleetmend/nats/{node}.nk"


# ------------------------------------------------------------------ issue 30 point 3: the chart an admin expects

@pytest.mark.parametrize(("values", "where"), [
    ({"affinty": {}}, "'affinty' not allowed"),
    ({"router": {"podAnnotation": {"a": "b"}}}, "'podAnnotation' not allowed"),
    ({"image": {"digest": "latest"}}, "/image/digest"),
    ({"policy": {"max_drained_nodes": 2.5}}, "/policy/max_drained_nodes"),
    ({"policy": {"max_drained_percent": "ten"}}, "/policy/max_drained_percent"),
    ({"router": {"replicas": "2"}}, "/router/replicas"),
    ({"agent": {"metricsPort": 70000}}, "/agent/metricsPort"),
    ({"scheduler": "slrum"}, "/scheduler"),
    ({"nats": {"tls": {"enabled": "yes"}}}, "/nats/tls/enabled"),
    ({"kubernetes": {"evict_timeout": 30}}, "'evict_timeout' not allowed"),
    ({"extraConfig": {"routr": {"max_deliver": 5}}}, "'routr' not allowed"),
    ({"agent": {"tolerations": {"key": "x"}}}, "/agent/tolerations"),
], ids=lambda v: str(v)[:40])
def test_the_values_schema_rejects_unknown_keys_and_wrong_types(values: dict, where: str) -> None:
    with pytest.raises(helm.HelmValuesError) as info:
        render(values)
    assert where in str(info.value), str(info.value)


def test_the_values_schema_is_generated_from_values_and_settings() -> None:
    import runpy

    gen = runpy.run_path(str(ROOT / "deploy/helm/gen_schema.py"))
    assert (CHART / "values.schema.json").read_text() == gen["render"](), \
        "values.schema.json is stale: run python deploy/helm/gen_schema.py"


def test_the_control_plane_never_runs_on_a_gpu_node_and_spreads(default_docs: list[dict]) -> None:
    for name, d in by_kind(default_docs, "Deployment").items():
        spec = d["spec"]["template"]["spec"]
        (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"]
        assert term["matchExpressions"] == [{"key": "nvidia.com/gpu.present", "operator": "NotIn",
                                             "values": ["true"]}], name
        anti = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
        assert anti["podAffinityTerm"]["labelSelector"]["matchLabels"] == d["spec"]["selector"]["matchLabels"]
        (spread,) = spec["topologySpreadConstraints"]
        assert spread["topologyKey"] == "topology.kubernetes.io/zone"
        assert spread["labelSelector"]["matchLabels"] == d["spec"]["selector"]["matchLabels"]
    # the agent's nodeSelector and the control plane's affinity exclude each other
    ds = by_kind(default_docs, "DaemonSet")["fleetmend-agent"]["spec"]["template"]["spec"]
    assert ds["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    off = by_kind(render({"controlPlane": {"avoidGpuNodes": False}}), "Deployment")["fleetmend-worker"]
    assert "nodeAffinity" not in off["spec"]["template"]["spec"]["affinity"]
    assert by_kind(default_docs, "Deployment")["fleetmend-analyzer"]["spec"]["replicas"] == 2


def test_the_agent_tolerates_every_taint(default_docs: list[dict]) -> None:
    pod = by_kind(default_docs, "DaemonSet")["fleetmend-agent"]["spec"]["template"]["spec"]
    assert pod["tolerations"] == [{"operator": "Exists"}]  # matches any taint, any effect
    assert by_kind(default_docs, "DaemonSet")["fleetmend-agent"]["spec"]["updateStrategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}}


def test_every_new_value_reaches_its_objects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    docs = render(EVERY_NEW_VALUE)
    deps, ds = by_kind(docs, "Deployment"), by_kind(docs, "DaemonSet")
    assert set(deps) == {"fm-router", "fm-worker", "fm-analyzer"} and set(ds) == {"fm-agent"}
    assert all(d["metadata"]["labels"]["app.kubernetes.io/name"] == "fleet" for d in docs)
    worker = deps["fm-worker"]["spec"]["template"]
    assert worker["metadata"]["labels"]["team"] == "gpu-ops" and worker["metadata"]["labels"]["w"] == "1"
    assert worker["metadata"]["annotations"]["example.com/owner"] == "gpu-ops"
    assert "checksum/config" in worker["metadata"]["annotations"]
    assert worker["spec"]["priorityClassName"] == "system-cluster-critical"
    assert deps["fm-worker"]["spec"]["strategy"] == {"type": "Recreate"}
    assert ds["fm-agent"]["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert deps["fm-router"]["spec"]["template"]["spec"]["topologySpreadConstraints"][0]["whenUnsatisfiable"] == \
        "DoNotSchedule"
    assert "podAntiAffinity" not in deps["fm-analyzer"]["spec"]["template"]["spec"]["affinity"]
    image = "ghcr.io/fleetmend/fleetmend@sha256:" + "a" * 64
    assert all(d["spec"]["template"]["spec"]["containers"][0]["image"] == image for d in deps.values())
    for sa in by_kind(docs, "ServiceAccount").values():
        assert sa["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/fm"}
    # TLS: the Secrets mounted where the settings point, and those settings load
    (c,) = worker["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in worker["spec"]["volumes"]}
    assert env["FLEETMEND_NATS_TLS__CERT_FILE"] == "/etc/fleetmend/tls/nats/tls.crt"
    assert env["FLEETMEND_TEMPORAL_TLS__CA_FILE"] == "/etc/fleetmend/tls/temporal/ca.crt"
    assert "FLEETMEND_TEMPORAL_TLS__CERT_FILE" not in env  # not mutual
    assert mounts["tls-nats"] == "/etc/fleetmend/tls/nats" and vols["tls-nats"]["secret"]["secretName"] == \
        "nats-client-tls"
    assert mounts["ca"] == "/etc/corp-ca" and vols["ca"]["configMap"]["name"] == "corp-ca"
    (a,) = ds["fm-agent"]["spec"]["template"]["spec"]["containers"]
    aenv = {e["name"]: e.get("value") for e in a["env"]}
    assert aenv["FLEETMEND_NATS_TLS__KEY_FILE"] == "/etc/fleetmend/tls/nats/tls.key"
    assert not any(k.startswith("FLEETMEND_TEMPORAL_TLS") for k in aenv)  # the agent never talks to Temporal
    assert {m["name"] for m in a["volumeMounts"]} >= {"tls-nats", "ca"}
    for k in [k for k in os.environ if k.startswith("FLEETMEND_")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        if v is not None and "TLS" in k:
            monkeypatch.setenv(k, v)
    s = load_settings(None)
    assert s.nats_tls.active and str(s.nats_tls.key_file) == "/etc/fleetmend/tls/nats/tls.key"
    assert s.nats_tls.server_name == "nats" and s.temporal_tls.active
    # the setup Job: extra environment, TLS and extra volumes
    (job,) = by_kind(docs, "Job").values()
    (jc,) = job["spec"]["template"]["spec"]["containers"]
    jenv = {e["name"]: e.get("value") for e in jc["env"]}
    assert jenv["HTTPS_PROXY"] == "http://proxy:3128" and jenv["FLEETMEND_TEMPORAL_TLS__ENABLED"] == "true"
    assert {m["name"] for m in jc["volumeMounts"]} == {"tls-temporal", "ca"}
    # NetworkPolicy: each Deployment's pods, ingress only to its metrics port, from the monitoring namespace
    pols = by_kind(docs, "NetworkPolicy")
    assert set(pols) == {"fm-router", "fm-worker", "fm-analyzer"}
    for name, pol in pols.items():
        assert pol["spec"]["podSelector"]["matchLabels"] == deps[name]["spec"]["selector"]["matchLabels"]
        (rule,) = pol["spec"]["ingress"]
        port = deps[name]["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
        assert rule["ports"] == [{"port": port, "protocol": "TCP"}]
        assert rule["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
        assert pol["spec"]["policyTypes"] == ["Ingress"]
    assert not by_kind(render({}), "NetworkPolicy")


def test_the_grafana_dashboard_ships_for_the_sidecar() -> None:
    import json

    packaged = (CHART / "dashboards/fleetmend.json").read_text()
    assert packaged == (ROOT / "deploy/grafana/fleetmend.json").read_text(), \
        "copy deploy/grafana/fleetmend.json to deploy/helm/fleetmend/dashboards/"
    docs = render({"grafana": {"dashboard": {"enabled": True, "namespace": "monitoring"}}})
    cm = by_kind(docs, "ConfigMap")["fleetmend-dashboard"]
    assert cm["metadata"]["namespace"] == "monitoring" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["fleetmend.json"]) == json.loads(packaged)
    assert "fleetmend-dashboard" not in by_kind(render({}), "ConfigMap")


def test_the_drain_skips_the_release_namespace(tmp_path: Path) -> None:
    cm = by_kind(render({}, namespace="gpu-health"), "ConfigMap")["fleetmend-config"]
    f = tmp_path / "fleetmend.toml"
    f.write_text(cm["data"]["fleetmend.toml"])
    k = load_settings(f).kubernetes
    assert k.skip_namespaces == ["kube-system", "gpu-operator", "network-operator", "gpu-health"]
    assert k.opt_out_label == "fleetmend.io/drain"
