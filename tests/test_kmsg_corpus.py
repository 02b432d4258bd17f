"""Every `kind == "kmsg"` case of the corpus (tests/corpus: cases.jsonl, cases-new.jsonl, cases-more.jsonl):
some emitted event matches `expected` on every field.

A case with `expected.severity == "info"` and nothing to act on (e.g. a falcon core-dump TRACE alone)
passes when the parser emits no event at all: the operator reading is "nothing to do".
"""

from __future__ import annotations

import pytest

from agents.kmsg import HEADS, KmsgParser, match_head, parse_text
from fleetmend.catalog import default_catalog
from fleetmend.events import FaultEvent, Source
from tests.corpus_paths import load_cases

KMSG_CASES = load_cases("kmsg")
OTHER_CASES = [c for c in load_cases() if c["kind"] != "kmsg"]


def _observed(e: FaultEvent) -> dict:
    cls = default_catalog().classify(e)
    return {
        "component": e.component.value,
        "xid": e.code if e.kind == "xid" else None,
        "pci_bus_id": e.device.pci_bus_id,
        "pid": e.pid,
        "severity": e.severity.value,
        "vendor_action": cls.immediate_action.value if e.kind == "xid" else None,
    }


def test_corpus_present() -> None:
    assert KMSG_CASES, "no kmsg cases found (corpus missing?)"


def test_heads_keep_to_their_kinds_and_order() -> None:
    """On every line of every corpus case, each head whose guard lets it run returns one of the kinds
    it lists in `HEADS`, and `match_head` returns the first such candidate."""
    seen: set[str] = set()
    for case in load_cases():
        for line in case["raw"].splitlines():
            t = line.strip()
            first = None
            for head in HEADS:
                c = head.build(t) if t and head.tries(t) else None
                if c is not None:
                    assert c.kind in head.kinds, (head.name, c.kind, t)
                    seen.add(head.name)
                    first = first or c
            assert match_head(line) == first, line
    assert seen == {h.name for h in HEADS}, f"heads no corpus line starts: {sorted({h.name for h in HEADS} - seen)}"


@pytest.mark.parametrize("case", KMSG_CASES, ids=[c["id"] for c in KMSG_CASES])
def test_kmsg_case(case: dict) -> None:
    events = parse_text(case["raw"], cluster="test", node="node-a01")
    expected = {k: case["expected"][k] for k in ("component", "xid", "pci_bus_id", "pid", "severity", "vendor_action")}
    observed = [_observed(e) for e in events]
    if not events and expected["severity"] == "info":
        return
    assert expected in observed, f"{case['id']}: expected {expected}\nemitted:\n" + "\n".join(map(str, observed))


@pytest.mark.parametrize("case", KMSG_CASES, ids=[c["id"] for c in KMSG_CASES])
def test_kmsg_case_event_shape(case: dict) -> None:
    for e in parse_text(case["raw"], cluster="test", node="node-a01"):
        assert e.source is Source.KMSG
        assert e.raw and e.message and "\n" not in e.message
        assert FaultEvent.from_json_bytes(e.to_json_bytes()) == e


@pytest.mark.parametrize("case", KMSG_CASES, ids=[c["id"] for c in KMSG_CASES])
def test_kmsg_case_streaming_equals_batch(case: dict) -> None:
    """feed() line by line with a flush after every line gives the same faults as one parse."""
    batch = {(e.kind, e.code, e.device.pci_bus_id, e.pid) for e in parse_text(case["raw"], node="n")}
    p = KmsgParser("local", "n", "test")
    stream = []
    for line in case["raw"].splitlines():
        stream.extend(p.feed(line))
    stream.extend(p.flush())
    assert {(e.kind, e.code, e.device.pci_bus_id, e.pid) for e in stream} == batch


@pytest.mark.parametrize("case", OTHER_CASES, ids=[c["id"] for c in OTHER_CASES])
def test_other_cases_do_not_crash(case: dict) -> None:
    parse_text(case["raw"], node="n")


def test_xid79_and_fallen_off_bus_are_one_event() -> None:
    case = next(c for c in KMSG_CASES if c["id"] == "c005")
    events = parse_text(case["raw"], node="n")
    assert [(e.kind, e.code) for e in events] == [("xid", 79)]
    assert "fallen off the bus" in events[0].raw and "nvidia-bug-report" in events[0].raw


def test_unrelated_lines_emit_nothing() -> None:
    text = "\n".join(
        [
            "[Sat Apr  3 05:23:18 2021] [UFW BLOCK] IN=enp6s0 OUT= MAC=01:00 SRC=0.0.0.0 DST=224.0.0.1 LEN=32",
            "Feb 14 05:03:41 node-a01 systemd[1]: Started systemd-journald.service - Journal Service.",
            "Feb 14 05:03:41 node-a01 kernel: workqueue: ib_cache_event_task [ib_core] hogged CPU for >10000us 4 times",
            "Feb 14 05:03:41 node-a01 kernel: EXT4-fs (md127p3): re-mounted 0000 r/w. Quota mode: none.",
            "10.0.0.1: kern: warning: [2026-04-22T21:27:51.291660856Z]: NVRM: kflcnCoreDumpNondestructive_IMPL: TRACE: 08 = 0x1",
        ]
    )
    assert parse_text(text, node="n") == []
