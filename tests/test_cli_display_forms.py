"""Issue 30's display rough edges, each failing on the code before its fix:

- a fault's count in `incidents show` was a bare "×1" in a column headed "×", beside kernel messages that end in
  "(x16)" (the parser's repeat count, read as a PCIe width): now "seen: once" and "(16 times)", and `explain`
  says "3 times" instead of "×3";
- a fail-slow GPU was `#7` in the fault's device (its key, the incident's device column) and `gpu:7` in the
  analyzer's finding: now `gpu:7` everywhere, and `explain` shows it instead of "-".
"""

from __future__ import annotations

import io

from rich.console import Console

from agents.kmsg import parse_text
from fleetmend.analyzer.metrics import device_of
from fleetmend.catalog import default_catalog
from fleetmend.cli.explain import Explained, render_entry
from fleetmend.cli.incidents import faults_table
from fleetmend.events import Component, FaultEvent, Severity, Source, condition_key, device_label

XID13 = ("[  100.0{i}0000] NVRM: Xid (PCI:0000:3b:00): 13, pid=1234, name=python, Graphics SM Warp Exception on "
         "(GPC 0, TPC 0, SM {i}): Out Of Range Address\n")
PCIE = ("[  5.000000] pci 0000:3b:00.0: 63.008 Gb/s available PCIe bandwidth, limited by 8.0 GT/s PCIe x8 link at "
        "0000:3a:00.0 (capable of 504.112 Gb/s with 32.0 GT/s PCIe x16 link)\n")


def _text(renderable) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(renderable)
    return out.getvalue()


def test_a_repeat_count_never_reads_as_a_pcie_width() -> None:
    [ev] = parse_text("".join(XID13.format(i=i) for i in range(3)), "c", "n1")
    assert ev.attrs["count"] == 3 and ev.message.endswith("(3 times)") and "(x3)" not in ev.message
    out = io.StringIO()
    render_entry(Explained(ev, default_catalog().classify(ev)), Console(file=out, width=200, color_system=None))
    assert "3 times" in out.getvalue() and "×" not in out.getvalue()


def test_the_incident_fault_table_says_how_often_in_words() -> None:
    [pcie] = parse_text(PCIE, "c", "n1")
    assert "x16" in pcie.message  # the kernel's own width stays as the kernel wrote it
    view = {"drained": False, "ticket": None, "faults": [
        {"kind": pcie.kind, "code": None, "device": "0000:3b:00.0", "severity": "degraded", "healthy": False,
         "immediate_action": "RESTART_BM", "count": 1, "message": pcie.message},
        {"kind": "xid", "code": 13, "device": "0000:3b:00.0", "severity": "info", "healthy": False,
         "immediate_action": "RESTART_APP", "count": 3, "message": "Out Of Range Address (3 times)"}]}
    text = _text(faults_table(view))
    assert "seen" in text and "once" in text and "3 times" in text
    assert "×" not in text


def test_a_gpu_known_by_index_has_one_form() -> None:
    dev = device_of("gpu:7")  # the analyzer's finding names the GPU so (fleetmend.analyzer.metrics)
    assert device_label(dev) == "gpu:7"
    ev = FaultEvent(cluster="c", node="n1", component=Component.GPU, device=dev, kind="fail_slow",
                    severity=Severity.DEGRADED, message="fail-slow: SM clock 0.71 vs peer median 1 on gpu:7",
                    source=Source.ANALYZER, raw="x")
    assert condition_key(ev).device == "gpu:7"  # the incident's device column and the fault's key
    out = io.StringIO()
    render_entry(Explained(ev, default_catalog().classify(ev)), Console(file=out, width=200, color_system=None))
    assert "gpu gpu:7" in out.getvalue() and "#7" not in out.getvalue()
