"""Text parsers for every kind of text the agent and `fleetmend explain` meet, beside the kernel log.

Public API:
    `detect_kinds(text) -> list[str]`: which formats the text contains, from "kmsg", "nvidia-smi",
        "dcgm", "other" (several for a pasted mix);
    `parse_any(text, cluster="local", node="local", catalog=None) -> list[FaultEvent]`: every
        parser over the text (the kernel-log parser always; the others where their formats match).
Modules: `nvidia_smi`, `dcgm` (also used by the diagnostics responder for `dcgmi diag`), `other`
(device plugin, CUDA/NCCL logs, mcelog, ibstat, ibv_devinfo, ibdev2netdev, BMC SEL), `common`.

A parser that raises on some input is a bug: `parse_any` logs it and goes on with the others
(the hypothesis tests feed random text to every parser to keep that from happening).
"""

from __future__ import annotations

import logging

from agents.kmsg import parse_text
from agents.parsers import dcgm, nvidia_smi, other
from agents.parsers.common import Ctx
from fleetmend.catalog import Catalog, default_catalog
from fleetmend.events import FaultEvent

log = logging.getLogger(__name__)

__all__ = ["detect_kinds", "parse_any"]


def detect_kinds(text: str) -> list[str]:
    """Formats present in `text` ("kmsg", "nvidia-smi", "dcgm", "other"); [] when none is recognised."""
    kinds = []
    if parse_text(text, node="n"):
        kinds.append("kmsg")
    ctx = Ctx()
    if nvidia_smi.looks_like(text) or nvidia_smi.parse(text, ctx):
        kinds.append("nvidia-smi")
    if dcgm.looks_like(text) or dcgm.parse(text, ctx):
        kinds.append("dcgm")
    if other.parse(text, ctx):
        kinds.append("other")
    return kinds


def parse_any(text: str, cluster: str = "local", node: str = "local", catalog: Catalog | None = None) -> list[FaultEvent]:
    """Every recognised fault in `text`, kernel-log events first, then nvidia-smi, DCGM and other tools."""
    cat = catalog or default_catalog()
    ctx = Ctx(cluster=cluster, node=node, catalog=cat)
    events = parse_text(text, cluster=cluster, node=node, catalog=cat)
    for name, fn in (("nvidia-smi", nvidia_smi.parse), ("dcgm", dcgm.parse), ("other", other.parse)):
        try:
            events += fn(text, ctx)
        except Exception as err:  # noqa: BLE001 - one parser's bug must not hide the others' events
            log.warning("text_parser_failed", extra={"parser": name, "error": repr(err)})
    return events
