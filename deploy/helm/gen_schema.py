"""Write `deploy/helm/fleetmend/values.schema.json`: the chart's values, closed (an unknown key is an
error at `helm install`/`template`, not a value silently dropped) and typed.

    python deploy/helm/gen_schema.py          # rewrite the schema
    python deploy/helm/gen_schema.py --check  # exit 1 when the committed schema is stale

Sources: the shape and types of `values.yaml` itself (every key there is a known key), with the
sections that become fleetmend.toml (`policy`, `kubernetes`, `tickets`, `extraConfig`) taken from
fleetmend's own settings models (`fleetmend.config`: the same field names, types and bounds the
processes enforce at start, so a fractional `policy.max_drained_nodes` fails at install), and the
Kubernetes pass-through values (resources, affinity, tolerations, extra volumes, ...) left to the
Kubernetes schema (tests/test_helm_chart.py validates every rendered object against it).
tests/test_helm_chart.py checks the committed file is this script's output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parent / "fleetmend"
SCHEMA = CHART / "values.schema.json"

FREE_OBJECT = {"nodeSelector", "resources", "affinity", "podLabels", "podAnnotations", "labels", "annotations",
               "pdb", "strategy", "updateStrategy", "limits", "requests"}
"""Maps and Kubernetes objects passed through as they are (keys are the user's or Kubernetes')."""
FREE_ARRAY = {"tolerations", "extraEnv", "extraVolumes", "extraVolumeMounts", "topologySpreadConstraints",
              "imagePullSecrets", "metricsFrom"}
"""Lists of Kubernetes objects passed through as they are."""
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
OVERRIDES: dict[str, dict[str, Any]] = {
    "cluster": {"type": "string", "minLength": 1},  # its rule is the template's (a message that says why)
    "scheduler": {"type": "string", "enum": ["kubernetes", "standalone", "slurm", "none"]},
    "logFormat": {"type": "string", "enum": ["auto", "json", "console"]},
    "image.pullPolicy": {"type": "string", "enum": ["Always", "IfNotPresent", "Never"]},
    "image.digest": {"type": "string", "pattern": "^$|^sha256:[a-f0-9]{64}$"},
    "agent.image.digest": {"type": "string", "pattern": "^$|^sha256:[a-f0-9]{64}$"},
    "temporal.retentionDays": {"type": "integer", "minimum": 0, "maximum": 3650},
    "temporal.setup.backoffLimit": {"type": "integer", "minimum": 0},
    "analyzer.args": {"type": "array", "items": {"type": "string"}},
    "agent.stateHostPath": {"type": "string", "pattern": "^/"},
}
SETTINGS_SECTIONS = {"policy": "PolicySettings", "kubernetes": "KubernetesSettings", "tickets": "TicketSettings"}


def _clean(node: Any, defs: dict[str, Any]) -> Any:
    """A pydantic JSON schema made plain: `$ref`s inlined, `format`, `title`, `default` and
    `description` dropped (Helm's validator needs none of them; `format: path` is not a JSON Schema
    format), no `required` (the chart's values are partial settings)."""
    if isinstance(node, dict):
        if "$ref" in node:
            return _clean(defs[node["$ref"].rsplit("/", 1)[1]], defs)
        return {k: _clean(v, defs) for k, v in node.items()
                if k not in ("format", "title", "default", "description", "required", "$defs")}
    if isinstance(node, list):
        return [_clean(x, defs) for x in node]
    return node


def settings_schema(model_name: str) -> dict[str, Any]:
    from fleetmend import config

    raw = getattr(config, model_name).model_json_schema()
    return _clean(raw, raw.get("$defs", {}))


def infer(value: Any, path: str) -> dict[str, Any]:
    key = path.rsplit(".", 1)[-1]
    if path in OVERRIDES:
        return OVERRIDES[path]
    if path in SETTINGS_SECTIONS:
        return settings_schema(SETTINGS_SECTIONS[path])
    if path == "extraConfig":
        s = settings_schema("Settings")
        for name in ("cluster", "scheduler", "kubernetes", "tickets", "policy"):  # set by their own values
            s["properties"].pop(name, None)
        return s
    if key == "metricsPort":
        return PORT
    if key == "replicas":
        return {"type": "integer", "minimum": 0}
    if key in FREE_OBJECT:
        return {"type": "object"}
    if key in FREE_ARRAY:
        return {"type": "array", "items": {"type": "object"}}
    if isinstance(value, bool):
        return {"type": "boolean"}
    if isinstance(value, int):
        return {"type": "integer"}
    if isinstance(value, float):
        return {"type": "number"}
    if isinstance(value, str):
        return {"type": "string"}
    if isinstance(value, list):
        return {"type": "array"}
    if isinstance(value, dict):
        return {"type": "object", "additionalProperties": False,
                "properties": {k: infer(v, f"{path}.{k}" if path else k) for k, v in value.items()}}
    return {}


def build() -> dict[str, Any]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = infer(values, "")
    return {"$schema": "http://json-schema.org/draft-07/schema#", "title": "fleetmend chart values",
            "description": "Generated by deploy/helm/gen_schema.py from values.yaml and fleetmend.config.",
            **schema}


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if SCHEMA.read_text() != text:
            print(f"{SCHEMA} is stale: run python deploy/helm/gen_schema.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA.write_text(text)
    print(f"wrote {SCHEMA}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
