"""Kernel-log probe and parser.

Public API:
    `KmsgParser(cluster, node, agent_version, catalog=None, driver_version=None)` with
    `feed(line) -> list[FaultEvent]` and `flush() -> list[FaultEvent]`;
    `parse_text(text, cluster="local", node=None, catalog=None) -> list[FaultEvent]`;
    `KmsgProbe(source=Path("/dev/kmsg"), parser=None, parser_factory=None, follow=True, state_dir=None)`
    with `name = "kmsg"` and `async run(emit)`.
Modules: `framing` (timestamp/prefix stripping), `matchers` (one message -> fault candidate),
`parser` (records, merging, classification), `probe` (/dev/kmsg and file replay).
"""

from agents.kmsg.framing import Deframer, Framed
from agents.kmsg.matchers import match_head, normalize_bdf
from agents.kmsg.parser import KmsgParser, parse_text
from agents.kmsg.probe import KmsgProbe

__all__ = ["Deframer", "Framed", "KmsgParser", "KmsgProbe", "match_head", "normalize_bdf", "parse_text"]
