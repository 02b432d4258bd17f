"""Render the Helm chart into plain manifests for installs without Helm: `deploy/kubernetes/fleetmend.yaml`.

    python -m scripts.render_manifests          # rewrite the file
    python -m scripts.render_manifests --check  # exit 1 when the file is stale

Uses Helm's own engine (`helm-python-sdk`), the chart's default values and namespace `fleetmend`.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy/helm/fleetmend"
OUT = ROOT / "deploy/kubernetes/fleetmend.yaml"
NAMESPACE = "fleetmend"
HEADER = f"""\
# GENERATED from deploy/helm/fleetmend with its default values (python -m scripts.render_manifests);
# do not edit: change the chart and re-render. Prefer `helm install` (README: Kubernetes).
# kubectl create namespace {NAMESPACE} && kubectl apply -n {NAMESPACE} -f fleetmend.yaml
"""


def render_manifests() -> str:
    import helm_python

    chart = helm_python.Chart.load(str(CHART))
    out = chart.render({}, name="fleetmend", namespace=NAMESPACE, is_install=True)
    parts = [HEADER]
    for path in sorted(out):
        text = out[path].strip()
        if path.endswith(".txt") or not text:
            continue
        parts.append(f"---\n# Source: {path}\n{text}\n")
    return "".join(parts)


def main(argv: list[str]) -> int:
    text = render_manifests()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python -m scripts.render_manifests", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
