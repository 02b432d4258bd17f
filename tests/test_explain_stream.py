"""Streaming kernel-log parsing (agents/kmsg/stream.py): the same events as feeding every line."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from agents.kmsg import KmsgParser, parse_text
from agents.kmsg.stream import parse_stream
from tests.corpus_paths import load_cases

HERE = Path(__file__).parent
NOISE = (HERE / "h200_boot_dmesg.txt").read_text()


def _texts() -> list[tuple[str, str]]:
    out = [(c["id"], c["raw"]) for c in load_cases("kmsg")]
    out += [(p.name, p.read_text()) for p in sorted((HERE / "crash_texts").glob("*.txt"))]
    out.append(("h200_boot", NOISE))
    mixed = "\n".join(NOISE + "\n" + raw for _, raw in out)  # every text between real boot-log noise
    out.append(("all_in_noise", mixed))
    return out


def _key(ev) -> dict:
    d = ev.model_dump(mode="json")
    d.pop("event_id")
    d.pop("observed_at")
    return d


@pytest.mark.parametrize(("name", "text"), _texts(), ids=[n for n, _ in _texts()])
@pytest.mark.parametrize("chunk_bytes", [257, 1 << 22])
def test_stream_finds_exactly_what_the_line_parser_finds(name: str, text: str, chunk_bytes: int) -> None:
    want = [_key(e) for e in parse_text(text, node="n1")]
    got = [_key(e) for e in parse_stream(io.BytesIO(text.encode()), KmsgParser("local", "n1", "unknown"),
                                         chunk_bytes=chunk_bytes)]
    assert got == want


def test_delta_framing_is_parsed_in_full_and_undecodable_bytes_are_replaced() -> None:
    text = ("[  +0.005106] ena 0000:00:03.0 eth0: Found a Tx that wasn't completed on time, qid 0, index 694.\n"
            "[  +0.000316] usb 1-4: new high-speed USB device number 5 using xhci_hcd\n")
    want = [_key(e) for e in parse_text(text, node="n1")]
    got = [_key(e) for e in parse_stream(io.BytesIO(text.encode()), KmsgParser("local", "n1", "unknown"))]
    assert got == want
    raw = b"[ 12.5] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.\xff\xfe\n"
    [ev] = parse_stream(io.BytesIO(raw), KmsgParser("local", "n1", "unknown"))
    assert ev.code == 79 and ev.device.pci_bus_id == "0000:3b:00.0" and "\ufffd" in ev.raw


def test_an_indented_block_whose_later_line_holds_the_token_is_joined_as_a_whole() -> None:
    text = NOISE + ("[ 7.0] kernel: message from the driver\n      wrapped by the collector\n"
                    "      NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.\n") + NOISE
    want = [_key(e) for e in parse_text(text, node="n1")]
    got = [_key(e) for e in parse_stream(io.BytesIO(text.encode()), KmsgParser("local", "n1", "unknown"))]
    assert got == want and want
