"""Runbooks generated from the catalog: docs/runbooks is up to date, `fleetmend runbook` prints one,
and a filed ticket points at it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleetmend.catalog import default_catalog
from fleetmend.catalog.runbooks import fault_classes, index, render, runbook_ref

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "runbooks"


def test_docs_runbooks_are_up_to_date_with_the_catalog() -> None:
    classes = fault_classes()
    expected = {f"{fc}.md": render(fc) for fc in classes} | {"README.md": index()}
    present = {p.name for p in DOCS.glob("*.md")}
    stale = sorted(n for n, text in expected.items() if n in present and (DOCS / n).read_text() != text)
    regen = "regenerate with `python -m fleetmend.catalog.runbooks docs/runbooks`"
    assert not (set(expected) - present), f"missing: {sorted(set(expected) - present)[:10]}; {regen}"
    assert not (present - set(expected)), f"no longer in the catalog: {sorted(present - set(expected))}; {regen}"
    assert not stale, f"out of date: {stale[:10]}; {regen}"


def test_every_fault_class_has_the_three_parts_from_its_catalog_entry() -> None:
    cat = default_catalog()
    classes = fault_classes(cat)
    assert "xid79" in classes and "gpu_fallen_off_bus" in classes and "xid65" in classes  # "Unused" on Ampere+: kept
    assert not any(k.healthy for k in cat.kinds.values() if k.name in classes)  # clearing events are not faults
    for fc, entry in classes.items():
        text = render(fc, cat)
        for part in ("## What it means", "## What fleetmend does", "## What a human checks", "## Source"):
            assert part in text, (fc, part)
        assert entry.description.rstrip(".") in text and entry.source in text
    x48 = render("xid48", cat)
    assert "**drains the node**" in x48 and "`remapped_rows_pending`" in x48 and "WORKFLOW_XID_48" in x48
    assert "does **not** drain" in render("xid13", cat)


def test_every_class_the_catalog_can_produce_has_a_runbook_the_pointer_opens(monkeypatch: pytest.MonkeyPatch) -> None:
    """F16: `status` pointed at `fleetmend runbook xid2 (docs/runbooks/xid2.md)` for an XID of the catalog
    (NVIDIA's Ampere+ catalog calls it "Unused"; 18 such XIDs drain) and neither the command nor the file
    existed. Every XID row and every non-clearing kind is a class `classify` can give a catalog verdict;
    each must open by the command and by the file the pointer names."""
    from typer.testing import CliRunner

    from fleetmend.cli.app import app

    cat = default_catalog()
    monkeypatch.setattr("fleetmend.cli.runbook.load_catalog", lambda overrides=None: cat)  # parsed once, not 300 times
    produced = {f"xid{n}" for n in cat.xids} | {k for k, e in cat.kinds.items() if not e.healthy}
    assert len(cat.xids) == 172 and produced <= set(fault_classes(cat)), sorted(produced - set(fault_classes(cat)))
    runner = CliRunner()
    for fc in sorted(produced):
        ref = runbook_ref(fc)
        path = REPO / ref[ref.index("(") + 1:-1]
        assert ref.startswith(f"fleetmend runbook {fc} (") and path.is_file(), (fc, ref)
        r = runner.invoke(app, ["runbook", fc, "--json"])
        assert r.exit_code == 0, (fc, r.output)
        assert json.loads(r.stdout)["markdown"] == path.read_text(), fc
    for n in (2, 65, 113):  # an unused driver/system XID; draining ones: what the older documentation calls them
        text = render(f"xid{n}", cat)
        assert "Ampere" in text and cat.xids[n].legacy_name_r555 in text and "Unused." not in text, n
    assert "**drains the node**" in render("xid65", cat) and "support_hardware" in render("xid65", cat)
    r = runner.invoke(app, ["runbook", "--list", "--json"])
    assert r.exit_code == 0 and set(json.loads(r.stdout)) == set(fault_classes(cat)) >= produced


def test_runbook_command() -> None:
    env = {**os.environ}
    p = subprocess.run([sys.executable, "-m", "fleetmend.cli.main", "runbook", "xid79", "--json"], capture_output=True,
                       text=True, cwd=REPO, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["fault_class"] == "xid79" and doc["markdown"] == (DOCS / "xid79.md").read_text()
    bad = subprocess.run([sys.executable, "-m", "fleetmend.cli.main", "runbook", "xid9999"], capture_output=True,
                         text=True, cwd=REPO, timeout=60, env=env)
    assert bad.returncode == 1 and bad.stdout == "" and "--list" in bad.stderr
    # an XID beyond the catalog: says so (not "no fault class") and what fleetmend does with it
    assert "XID 9999 is not in the catalog" in bad.stderr and "1 to 172" in bad.stderr, bad.stderr
    for spelled in ("XID79", "xid 79", "79"):  # as `explain` and `status` print it, or the bare number
        p = subprocess.run([sys.executable, "-m", "fleetmend.cli.main", "runbook", spelled, "--json"],
                           capture_output=True, text=True, cwd=REPO, timeout=60, env=env)
        assert p.returncode == 0 and json.loads(p.stdout)["fault_class"] == "xid79", (spelled, p.stderr)


async def test_a_filed_ticket_points_at_the_runbook(tmp_path: Path) -> None:
    from temporalio.testing import ActivityEnvironment

    from activities.ticket_store import LocalTicketStore
    from activities.tickets import TicketActivities
    from fleetmend.messages import TicketRequest

    store = LocalTicketStore(tmp_path)
    ref = await ActivityEnvironment().run(TicketActivities(store).file_ticket, TicketRequest(
        incident_id="inc-1", cluster="c", node="n", title="n: xid79", severity="fatal", fault_class="xid79",
        evidence={"raw": "NVRM: Xid 79"}))
    doc = await store.get(ref.ticket_id)
    assert doc["evidence"]["runbook"] == runbook_ref("xid79") == "fleetmend runbook xid79 (docs/runbooks/xid79.md)"
