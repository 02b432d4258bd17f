"""The ACS decoder against recorded real outputs (tests/fixtures/hosts/recorded/, each with its source): the ACS
capability where real hosts put it (behind other extended capabilities, at 0x2a0) and the control values
`lspci -vvv` printed, encoded as configuration space and read back by `agents.inventory.pci`."""

from __future__ import annotations

import re
import struct
from pathlib import Path

from agents.inventory.pci import acs_source_validation

RECORDED = Path(__file__).parent / "fixtures" / "hosts" / "recorded"
ACSCTL_BITS = ("SrcValid", "TransBlk", "ReqRedir", "CmpltRedir", "UpstreamFwd", "EgressCtrl", "DirectTrans")
"""Bit order of the ACS Control register as pciutils ls-ecaps.c prints it (PCIe Base Spec §7.7.8.3)."""


def config_with_acs_at(offset: int, ctrl: int) -> bytes:
    """4 KiB of config space: AER (0x0001) at 0x100 pointing to a second capability, then ACS at `offset`."""
    cfg = bytearray(4096)
    struct.pack_into("<I", cfg, 0x100, 0x0001 | (1 << 16) | (0x150 << 20))  # AER → 0x150
    struct.pack_into("<I", cfg, 0x150, 0x000B | (1 << 16) | (offset << 20))  # vendor-specific → ACS
    struct.pack_into("<I", cfg, offset, 0x000D | (1 << 16))
    struct.pack_into("<HH", cfg, offset + 4, 0x005F, ctrl)
    return bytes(cfg)


def test_recorded_setpci_offsets_decode() -> None:
    rows = [re.match(r"(\S+) \(ecap 000d @([0-9a-f]+)\) @([0-9a-f]+) ([0-9a-f]{4})", line)
            for line in (RECORDED / "acs_setpci_nccl606.txt").read_text().splitlines() if not line.startswith("#")]
    assert len(rows) == 5 and all(rows)
    for m in rows:
        assert m is not None
        offset, ctrl_at, value = int(m[2], 16), int(m[3], 16), int(m[4], 16)
        assert ctrl_at == offset + 6  # the control register sits at +6, as the decoder reads it
        assert acs_source_validation(config_with_acs_at(offset, value)) is False  # 0000: ACS off everywhere


def test_recorded_lspci_acsctl_lines_decode_as_lspci_printed() -> None:
    lines = [ln.split("ACSCtl:")[1].split() for ln in (RECORDED / "acsctl_lspci_nccl523.txt").read_text().splitlines()
             if "ACSCtl:" in ln]
    assert len(lines) == 4
    for flags in lines:
        ctrl = sum(1 << i for i, name in enumerate(ACSCTL_BITS) if f"{name}+" in flags)
        assert acs_source_validation(config_with_acs_at(0x2A0, ctrl)) is ("SrcValid+" in flags)
    assert [("SrcValid+" in f) for f in lines] == [True, False, False, True]
