"""The word tests that case-insensitive head patterns run behind (`matchers.may_hold`, added for speed on lines that
start nothing) change no reading: a fault line in another letter case, or holding a letter re.IGNORECASE folds onto an
ASCII one (KELVIN SIGN onto k, long s onto s), reads as it did with the pattern alone (kinds checked against the code
before the tests were added)."""

from __future__ import annotations

import pytest

from agents.kmsg.heads import match_head
from agents.kmsg.matchers import lowered, may_hold

K = "\u212a"  # KELVIN SIGN
S = "\u017f"  # LATIN SMALL LETTER LONG S

CASES = [
    ("mlx5_core 0000:ab:00.0 mlx5_5: port: 1 link down", "ib_port_down"),
    (f"mlx5_core 0000:ab:00.0 mlx5_5: Port: 1 Lin{K} ACTIVE", "ib_port_active"),
    ("mlx5_core 0000:3b:00.0: Detected INSUFFICIENT POWER ON THE PCIE SLOT (27W).", "ib_insufficient_power"),
    (f"mlx5_core 0000:3b:00.0: Detected in{S}ufficient power on the PCIe slot (27W).", "ib_insufficient_power"),
    ("mlx5_core 0000:3b:00.0: mlx5_cmd_out_err:838:(pid 1): access_reg(0x805) op_mod(0x1) failed, status bad "
     "parameter(0x3)", "ib_access_reg_noise"),
    ("pcieport 0000:00:03.0: AER: Corrected error RECEIVED: 0000:00:03.0", "aer_corrected"),
    (f"pcieport 0000:00:03.0: AER: Corrected error me{S}{S}age received: 0000:00:03.0", "aer_corrected"),
    ("pcieport 0000:00:03.0: AER: pcie bus error: severity=Corrected, type=Physical Layer, (Receiver ID)",
     "aer_corrected"),
    ("pcieport 0000:00:03.0: AER: Device Recovery FAILED", "aer_recovery_failed"),
    ("NVRM: GPU0 kgspHealthCheck_TU102: GSP-RM unresponsive", "gsp_error"),
    (f"NVRM: GPU0 G{S}P RPC timeout", "gsp_error"),
    ("NVRM: LIBOS HEARTBEAT TIMED OUT", "gsp_error"),
    ("NVRM: GPU 0000:3b:00.0: Unexpected wpr2 already up", "gsp_error"),
    ("NVRM: nvlink: link DISCOVERY failed", "nvlink_discovery_failed"),
    (f"NVRM: nvlin{K}: link discovery fail", "nvlink_discovery_failed"),
    ("NVRM: GPU 0000:3b:00.0: RESET REQUIRED", "gpu_reset_required"),
    (f"NVRM: GPU 0000:3b:00.0: Re{S}et required", "gpu_reset_required"),
]


@pytest.mark.parametrize(("line", "kind"), CASES)
def test_a_guarded_pattern_reads_its_line_in_any_case(line: str, kind: str) -> None:
    cand = match_head(line)
    assert cand is not None and cand.kind == kind


def test_may_hold_is_exact_for_ascii_and_lets_other_text_through() -> None:
    assert may_hold("Port: 1 LINK", "port: ") and not may_hold("Port 1 LINK", "port: ")
    assert may_hold(f"Lin{K}", "nothing")  # not ASCII: always tried by the pattern itself
    a, b = "Some TEXT", "some text".upper()
    assert lowered(a) == "some text" and lowered(b) == "some text" and lowered(a) == "some text"
