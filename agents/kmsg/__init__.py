"""Kernel-log probe and parser.

Public API:
    `KmsgParser(cluster, node, agent_version, catalog=None, driver_version=None)` with
    `feed(line) -> list[FaultEvent]` and `flush() -> list[FaultEvent]`;
    `parse_text(text, cluster="local", node=None, catalog=None) -> list[FaultEvent]`;
    `KmsgProbe(source=Path("/dev/kmsg"), parser=None, parser_factory=None, follow=True, state_dir=None)`
    with `name = "kmsg"` and `async run(emit)`.
Modules: `framing` (timestamp/prefix stripping), `heads` (the ordered `HEADS` table: which messages
start a fault record, `match_head`), `matchers` (the patterns and builders: one message -> fault candidate),
`parser` (records, merging, classification), `probe` (/dev/kmsg and file replay).
"""

from agents.kmsg.framing import Deframer, Framed
from agents.kmsg.heads import HEADS, match_head
from agents.kmsg.matchers import normalize_bdf
from agents.kmsg.parser import KmsgParser, parse_text
from agents.kmsg.probe import KmsgProbe

__all__ = ["HEADS", "Deframer", "Framed", "KmsgParser", "KmsgProbe", "match_head", "normalize_bdf", "parse_text"]
