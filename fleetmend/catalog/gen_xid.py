"""Generate the reviewable XID catalog TOML from NVIDIA's tables and fleetmend's reading rules.

Reads `source/xid_catalog.tsv` (NVIDIA's XID catalog as data, one XID a row),
`source/xid_nvlink5_decode.tsv` (the catalog's 'Xid 144-150 Decode' sheet) and `xid_reading.toml`
(how fleetmend reads each row: component, severity, drain, recovery, verify, history, each rule with
its reason), all beside this module, and writes `xid.toml` and `nvlink5.toml` there. Run it when a
source table or a reading rule changes; the TOML is committed, and the catalog reads only it:

    .venv/bin/python -m fleetmend.catalog.gen_xid [--source DIR] [--out DIR]

NVIDIA's fields are transcribed unchanged. Below them each row gets fleetmend's reading, written out
so the row says everything that happens on that XID, with a comment naming the rules that gave it
(`xid_reading.toml` holds the rules, their order and their reasons). `tests/test_catalog.py` checks
that the committed TOML is what this writes.
"""

from __future__ import annotations

import argparse
import csv
import json
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fleetmend.errors import CatalogError
from fleetmend.events import Component, History, Recovery, Severity, Urgency

CATALOG = Path(__file__).resolve().parent
SOURCE = CATALOG / "source"
READING = CATALOG / "xid_reading.toml"


class _Named(BaseModel):
    """What every reading rule has: a name (unique in its section) and why it reads as it does."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z0-9_]+$")
    reason: str = Field(min_length=1)


class ComponentRule(_Named):
    """`[[component]]`: rows of `xids` (None: any row) report this component."""

    component: Component
    xids: list[int] | None = None

    def fits(self, n: int) -> bool:
        return self.xids is None or n in self.xids


class _Rule(_Named):
    """A rule that fits rows by what NVIDIA says about them; a field left out fits any row."""

    immediate_action: list[str] | None = None
    """Fits rows with one of these immediate actions."""
    hardware: bool | None = None
    """Fits rows whose hardware-versus-application reading starts with "hardware" (True) or not (False)."""
    component: Component | None = None
    """Fits rows of this component (`[[component]]`)."""
    xids: list[int] | None = None

    def fits(self, n: int, action: str, hardware: bool, component: Component) -> bool:
        return ((self.immediate_action is None or action in self.immediate_action)
                and (self.hardware is None or self.hardware == hardware)
                and (self.component is None or self.component == component)
                and (self.xids is None or n in self.xids))


class SeverityRule(_Rule):
    decoded: bool = False
    """The row leaves severity and drain out: they are decoded per event."""
    severity: Severity | None = None
    drain: bool | None = None


class RecoveryRule(_Rule):
    recovery: Recovery


class VerifyRule(_Rule):
    checks: list[str]


class XidReading(BaseModel):
    """`[xid.N]`: one XID's own reading (history rule) or an exception to the rules."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    recovery: Recovery | None = None
    recovery_reason: str = ""
    history: History | None = None
    urgency: Urgency = Urgency.NOW
    history_source: str = ""


class Reading(BaseModel):
    """`xid_reading.toml`, validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    component: list[ComponentRule]
    severity: list[SeverityRule]
    recovery: list[RecoveryRule]
    verify: list[VerifyRule]
    xid: dict[int, XidReading] = Field(default_factory=dict)


def load_reading(path: Path = READING) -> Reading:
    """`xid_reading.toml` as a `Reading`. Raises CatalogError naming the file and the entry."""
    try:
        data: dict[str, Any] = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise CatalogError(f"{path}: not valid TOML: {err}") from err
    try:
        reading = Reading.model_validate(data)
    except ValidationError as err:
        problems = "; ".join(f"{_where(data, e['loc'])}: {e['msg']}" for e in err.errors())
        raise CatalogError(f"{path}: {problems}") from err
    for section in ("component", "severity", "recovery", "verify"):
        names = [r.name for r in getattr(reading, section)]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise CatalogError(f"{path}: [[{section}]]: rule names used twice: {dupes}")
    for n, x in reading.xid.items():
        if x.recovery is not None and not x.recovery_reason:
            raise CatalogError(f"{path}: [xid.{n}]: recovery needs a recovery_reason")
        if x.history is not None and not x.history_source:
            raise CatalogError(f"{path}: [xid.{n}]: history needs a history_source")
    return reading


def _where(data: dict[str, Any], loc: tuple[Any, ...]) -> str:
    """`[[severity]] "fatal"`-style name of the entry a validation error is about."""
    if len(loc) >= 2 and isinstance(loc[1], int) and isinstance(data.get(loc[0]), list):
        entry = data[loc[0]][loc[1]]
        name = entry.get("name", f"#{loc[1]}") if isinstance(entry, dict) else f"#{loc[1]}"
        return f"[[{loc[0]}]] {name}: " + ".".join(map(str, loc[2:]))
    if len(loc) >= 2 and loc[0] == "xid":
        return f"[xid.{loc[1]}]: " + ".".join(map(str, loc[2:]))
    return ".".join(map(str, loc)) or "(file)"


def _first(rules: list[Any], n: int, *fields: Any) -> Any:
    """The first rule of a section that fits XID `n`. Raises CatalogError when none does."""
    for rule in rules:
        if rule.fits(n, *fields):
            return rule
    section = type(rules[0]).__name__ if rules else "a section"
    raise CatalogError(f"{READING.name}: XID {n} ({', '.join(map(str, fields))}) fits no {section}")


def reading(n: int, action: str, hw_vs_app: str, component: str, rules: Reading | None = None) -> list[str]:
    """fleetmend's fields for one XID row, as TOML lines, after a comment naming the rules that gave
    them (`severity.NAME`, `recovery.NAME`, `verify.NAME` rules and the XID's own `[xid.N]` table of
    `xid_reading.toml`)."""
    rules = rules or load_reading()
    hardware = hw_vs_app.strip().lower().startswith("hardware")
    comp = Component(component)
    own = rules.xid.get(n, XidReading())
    lines = []
    sev: SeverityRule = _first(rules.severity, n, action, hardware, comp)
    used = [f"severity.{sev.name}"]
    if not sev.decoded:
        lines += [f"severity = {_s(str(sev.severity))}", f"drain = {'true' if sev.drain else 'false'}"]
    if own.recovery is not None:
        recovery = own.recovery
    else:
        rec: RecoveryRule = _first(rules.recovery, n, action, hardware, comp)
        recovery = rec.recovery
        used.append(f"recovery.{rec.name}")
    lines.append(f"recovery = {_s(str(recovery))}")
    verify: VerifyRule = _first(rules.verify, n, action, hardware, comp)
    used.append(f"verify.{verify.name}")
    lines.append(f"verify = {json.dumps(verify.checks)}")
    if n in rules.xid:
        used.append(f"[xid.{n}]")
    lines.insert(0, f"# fleetmend's reading (xid_reading.toml: {', '.join(used)}):")
    if own.history is not None:
        lines.append(f"history = {_s(str(own.history))}")
        if own.urgency is not Urgency.NOW:
            lines.append(f"urgency = {_s(str(own.urgency))}")
        lines.append(f"history_source = {_s(own.history_source)}")
    return lines


def _s(value: str) -> str:
    """A TOML basic string (JSON string escapes are valid TOML escapes)."""
    return json.dumps(value, ensure_ascii=False)


def _action(value: str) -> str:
    value = value.strip()
    return "NONE" if value.startswith("(none") else value


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))


def gen_xid(src: Path, rules: Reading | None = None) -> str:
    rules = rules or load_reading()
    out = [
        "# NVIDIA XID catalog, generated by `python -m fleetmend.catalog.gen_xid` from source/xid_catalog.tsv",
        "# (NVIDIA's fields, verbatim) and xid_reading.toml (fleetmend's reading rules, with their reasons).",
        "# Do not edit by hand: change a rule in xid_reading.toml, or override entries in the operator catalog overrides.",
        "# immediate_action: NVIDIA's 'Immediate Action' (\"NONE\" where the catalog assigns none).",
        "# hw_vs_app: hardware-versus-application reading (legacy cause matrix, r555).",
        "# Below NVIDIA's fields, fleetmend's reading of each XID: severity, drain, urgency, recovery, verify,",
        "# history (fleetmend/catalog/__init__.py says what each means), after a comment naming the rules that",
        "# gave them (severity.NAME is the [[severity]] rule NAME of xid_reading.toml; [xid.N] the XID's own table).",
        "",
    ]
    for row in _rows(src):
        n = int(row["xid"])
        action = _action(row["immediate_action"])
        component = _first(rules.component, n).component
        out.append(f"[xid.{n}]")
        out.append(f"mnemonic = {_s(row['mnemonic'])}")
        out.append(f"description = {_s(row['description'])}")
        out.append(f"immediate_action = {_s(action)}")
        out.append(f"investigatory_action = {_s(row['investigatory_action'].strip())}")
        out.append(f"hw_vs_app = {_s(row['hw_vs_app'])}")
        out.append(f"component = {_s(str(component))}")
        out.append(f"legacy_possible_causes = {_s(row['legacy_possible_causes'])}")
        out.append(f"legacy_name_r555 = {_s(row['legacy_name_r555'])}")
        out.append(f"source = {_s(row['source'])}")
        out.extend(reading(n, action, row["hw_vs_app"], str(component), rules))
        out.append("")
    return "\n".join(out)


def gen_nvlink5(src: Path) -> str:
    out = [
        "# NVLink5 decode rules for XID 144-150, generated by `python -m fleetmend.catalog.gen_xid` from",
        "# source/xid_nvlink5_decode.tsv (NVIDIA Xid Catalog sheet 'Xid 144-150 Decode'), verbatim.",
        "# intrinfo patterns: 32 characters, most significant bit first, '-' = any bit.",
        "# v1 applies to drivers before R575, v2 to R575 and later.",
        "",
    ]
    for row in _rows(src):
        out.append("[[rule]]")
        out.append(f"xid = {int(row['xid'])}")
        out.append(f"unit = {_s(row['unit'])}")
        out.append(f"intrinfo_pattern_v1 = {_s(row['intrinfo_pattern_v1(<R575)'])}")
        out.append(f"intrinfo_pattern_v2 = {_s(row['intrinfo_pattern_v2(>=R575)'])}")
        out.append(f"error_status = {_s(row['error_status'])}")
        out.append(f"resolution = {_s(_action(row['resolution']))}")
        out.append(f"investigatory = {_s(row['investigatory'])}")
        out.append(f"severity = {_s(row['severity'])}")
        out.append(f"hw_sw = {_s(row['hw_sw'])}")
        out.append(f"local_remote_effect = {_s(row['local_remote_effect'])}")
        out.append(f"source = {_s(row['source'])}")
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--source", type=Path, default=SOURCE, help="directory with NVIDIA's TSVs")
    ap.add_argument("--out", type=Path, default=CATALOG)
    args = ap.parse_args()
    (args.out / "xid.toml").write_text(gen_xid(args.source / "xid_catalog.tsv"), encoding="utf-8")
    (args.out / "nvlink5.toml").write_text(gen_nvlink5(args.source / "xid_nvlink5_decode.tsv"), encoding="utf-8")
    print(f"wrote {args.out / 'xid.toml'} and {args.out / 'nvlink5.toml'}")


if __name__ == "__main__":
    main()
