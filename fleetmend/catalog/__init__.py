"""The fault catalog: data (TOML) that maps an observed fault to severity, actions and its source.

Files (package data, validated once at load):

- `xid.toml`: NVIDIA's XID catalog (Ampere+ catalog + r555 legacy cause matrix), generated from the
  XID catalog TSV by `scripts/gen_xid_catalog.py`. One `[xid.N]` table per XID.
- `nvlink5.toml`: the catalog's 'Xid 144-150 Decode' sheet: `[[rule]]` tables matching the NVLink5
  intrinfo word (32-bit pattern with `-` wildcards; v1 for drivers < R575, v2 for >= R575) and the
  error-status word to a unit, severity and resolution.
- `kinds.toml`: every non-XID kind the probes emit (`gpu_fallen_off_bus`, `aer_fatal`, `hung_task`, ...),
  hand-written, each naming its clearing kind (or "none: <why>") and its source.

Operators override any entry with their own TOML (`load_catalog(overrides=Path)`), same layout:
`[xid.79] immediate_action = "RMA"`, `[kind.aer_corrected] severity = "degraded"`. Unknown keys are
errors (`CatalogError` naming the file and entry).

What each fault class does is data, one row per XID (`[xid.N]`) or kind (`[kind.NAME]`), so "what
happens on XID 79" is one table in `xid.toml`:

- `severity`, `drain`: how bad, and whether automation takes the node out of service. XID rows get
  them from `scripts/gen_xid_catalog.py` (NVIDIA's immediate action + hardware-versus-application
  reading; the rules and their sources are in the generator). XID 144-150 (`WORKFLOW_NVLINK5_ERR`)
  and 154 (`XID_154`) rows leave them out: they are decoded per event (NVLink5 rule table; the
  recovery action the driver printed), unless an override sets them.
- `urgency`: `now` (default) or `when_idle` (running jobs finish first).
- `recovery`: what the incident tries after the drain, before a vendor ticket: `RESET_GPU` (GPU reset,
  then a reboot), `RESTART_BM` (reboot), `RMA` (straight to a ticket), `DRAIN_DIAGNOSE` (diagnose, ticket).
- `verify`: the agent checks that prove the fault gone (agents/diag.py names); empty = every QUICK check.
- `history`: the history rule that reads this class (fleetmend/policy.py): `repeats` (an application
  XID repeating on one GPU), `sympathetic` (a consequence of another XID), `dbe` / `remap_pending` /
  `remap_failure` (a DBE with a row-remap XID), `rate` (a rising corrected-error rate).
- `cleared_by` (kinds): the clearing kind, or "none: <why>"; `source`: where the row comes from.

Operators override any row with their own TOML (`load_catalog(overrides=Path)`), same layout:
`[xid.79] recovery = "RESTART_BM"`, `[kind.aer_corrected] severity = "degraded"`. Unknown keys are
errors (`CatalogError` naming the file and entry).

Imports only stdlib, pydantic and the fleetmend contract.
"""


import re
import tomllib
from enum import StrEnum
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fleetmend.errors import CatalogError
from fleetmend.events import Component, FaultEvent, History, Recovery, Severity, Urgency, Verdict

__all__ = [
    "Action",
    "Catalog",
    "Classification",
    "KindEntry",
    "Verdict",
    "Nvlink5Decode",
    "Nvlink5Rule",
    "Recovery",
    "RecoveryActionEntry",
    "Urgency",
    "XidEntry",
    "default_catalog",
    "load_catalog",
]


class Action(StrEnum):
    """Immediate actions. Stable wire strings (NVIDIA catalog names where they exist); never reuse."""

    IGNORE = "IGNORE"
    RESTART_APP = "RESTART_APP"
    RESET_GPU = "RESET_GPU"
    RESTART_BM = "RESTART_BM"
    RESTART_VM = "RESTART_VM"
    DRAIN_DIAGNOSE = "DRAIN_DIAGNOSE"
    RMA = "RMA"
    CONTACT_SUPPORT = "CONTACT_SUPPORT"
    CHECK_MECHANICALS = "CHECK_MECHANICALS"
    CHECK_UVM = "CHECK_UVM"
    UPDATE_SWFW = "UPDATE_SWFW"
    WORKFLOW_NVLINK_ERR = "WORKFLOW_NVLINK_ERR"
    WORKFLOW_NVLINK5_ERR = "WORKFLOW_NVLINK5_ERR"
    WORKFLOW_XID_45 = "WORKFLOW_XID_45"
    WORKFLOW_XID_48 = "WORKFLOW_XID_48"
    XID_154 = "XID_154"
    XID_154_EVAL = "XID_154_EVAL"
    NONE = "NONE"
    """The catalog assigns no action (newest XIDs)."""


_DECODED = frozenset({"WORKFLOW_NVLINK5_ERR", "XID_154"})
"""Immediate actions whose severity is decoded per event (a row may leave severity/drain out)."""


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class XidEntry(_Entry):
    """One `[xid.N]` table of `xid.toml` (NVIDIA's catalog fields, verbatim)."""

    xid: int = Field(ge=0)
    mnemonic: str
    description: str
    immediate_action: Action
    investigatory_action: str
    hw_vs_app: str
    component: Component = Component.GPU
    legacy_possible_causes: str = ""
    legacy_name_r555: str = ""
    source: str = Field(min_length=1)
    severity: Severity | None = None
    """None only on rows decoded per event (XID 144-150, 154): see the module docstring."""
    drain: bool | None = None
    urgency: Urgency = Urgency.NOW
    recovery: Recovery
    verify: list[str] = Field(default_factory=list)
    history: History | None = None
    history_source: str = ""
    """Where the `history` / `urgency` reading comes from (set together with them)."""

    @model_validator(mode="after")
    def _severity_given(self) -> "XidEntry":
        if self.immediate_action.value not in _DECODED and (self.severity is None or self.drain is None):
            raise ValueError(f"severity and drain are required (only {sorted(_DECODED)} rows are decoded per event)")
        return self

    @property
    def base_severity(self) -> Severity:
        """The row's severity; for a row decoded per event, what it is until decoded (info for XID 154,
        degraded otherwise)."""
        if self.severity is not None:
            return self.severity
        return Severity.INFO if self.immediate_action is Action.XID_154 else Severity.DEGRADED


class KindEntry(_Entry):
    """One `[kind.NAME]` table of `kinds.toml` (a non-XID fault or clearing kind)."""

    name: str = Field(pattern=r"^[a-z0-9_]+$")
    component: Component
    severity: Severity
    drain: bool = False
    immediate_action: Action
    investigatory_action: str
    description: str
    source: str = Field(min_length=1)
    healthy: bool = False
    clears: list[str] = Field(default_factory=list)
    cleared_by: str = Field(min_length=1)
    follows_recovery_action: bool = False
    """Severity and drain follow `attrs["recovery_action"]` (Reset/Reboot: fatal + drain, Drain P2P:
    degraded), as for XID 154; `severity` is the reading when the action is unknown."""
    escalate_to: str | None = None
    """Kind that `escalate_count` occurrences on one device within `escalate_window_s` become."""
    escalate_count: int | None = Field(default=None, ge=2)
    escalate_window_s: float | None = Field(default=None, gt=0)
    escalate_reason: str | None = None
    """Why that threshold (required with `escalate_to`)."""
    urgency: Urgency = Urgency.NOW
    recovery: Recovery
    verify: list[str] = Field(default_factory=list)
    history: History | None = None
    history_source: str = ""

    @field_validator("cleared_by")
    @classmethod
    def _cleared_by(cls, v: str) -> str:
        if not (v.startswith("none:") or re.fullmatch(r"[a-z0-9_]+", v)):
            raise ValueError(f"cleared_by {v!r}: name a clearing kind or write 'none: <why>'")
        return v


_PATTERN = re.compile(r"^[01-]{32}$")


class Nvlink5Rule(_Entry):
    """One row of NVIDIA's 'Xid 144-150 Decode' sheet."""

    xid: int = Field(ge=144, le=150)
    unit: str
    intrinfo_pattern_v1: str
    intrinfo_pattern_v2: str
    error_status: int
    resolution: Action
    investigatory: str
    severity: str
    hw_sw: str
    local_remote_effect: str = ""
    source: str = Field(min_length=1)

    @field_validator("intrinfo_pattern_v1", "intrinfo_pattern_v2")
    @classmethod
    def _pattern(cls, v: str) -> str:
        if not _PATTERN.match(v):
            raise ValueError(f"intrinfo pattern {v!r} is not 32 characters of 0, 1 and -")
        return v

    @field_validator("error_status", mode="before")
    @classmethod
    def _hex(cls, v: Any) -> Any:
        return int(v, 16) if isinstance(v, str) else v

    @property
    def fatal(self) -> bool:
        """True for 'Fatal', 'Fatal**', 'Link Fatal', 'Link Fatal?'; False for 'Non-fatal'."""
        s = self.severity.lower()
        return "fatal" in s and "non" not in s

    def matches(self, intrinfo: int, version: str) -> bool:
        """Whether `intrinfo` (32-bit) fits the v1 or v2 pattern (MSB first, '-' = any bit)."""
        pattern = self.intrinfo_pattern_v1 if version == "v1" else self.intrinfo_pattern_v2
        bits = format(intrinfo & 0xFFFFFFFF, "032b")
        return all(p == "-" or p == b for p, b in zip(pattern, bits))


class Nvlink5Decode(BaseModel):
    """Result of decoding an XID 144-150 intrinfo/error-status pair."""

    model_config = ConfigDict(frozen=True)

    unit: str
    severity: Severity
    resolution: Action | None
    investigatory: str | None
    hw_sw: str | None
    pattern_version: str
    """'v1' (driver < R575) or 'v2' (>= R575) - the pattern set that matched."""
    source: str


class Classification(BaseModel):
    """What the catalog says about one event.

    Fields: severity; immediate_action (NVIDIA's for XIDs); investigatory_action; source (the catalog
    entry's citation); fault_class (short stable label: `xid79`, `aer_fatal`); description; drain
    (automation may take the node out of service); component; resolution (XID 144-150: the decoded
    rule's resolution, e.g. RESET_GPU, while immediate_action stays WORKFLOW_NVLINK5_ERR); unit
    (XID 144-150 decoded unit).
    """

    model_config = ConfigDict(frozen=True)

    severity: Severity
    immediate_action: Action
    investigatory_action: str
    source: str
    fault_class: str
    description: str
    drain: bool
    component: Component | None = None
    resolution: Action | None = None
    unit: str | None = None


def _driver_major(version: str | int | float | bool | None) -> int | None:
    if version is None or isinstance(version, bool):
        return None
    m = re.match(r"\s*(\d+)", str(version))
    return int(m.group(1)) if m else None


class RecoveryActionEntry(_Entry):
    """One `[action.NAME]` row of `recovery_actions.toml`: a GPU recovery action the driver asks for."""

    name: str
    nvml: int = Field(ge=0)
    severity: Severity
    drain: bool
    words: list[str] = Field(default_factory=list)


class Catalog:
    """The loaded, validated catalog. Build with `load_catalog()` (or `default_catalog()`)."""

    def __init__(self, xids: dict[int, XidEntry], kinds: dict[str, KindEntry], nvlink5: list[Nvlink5Rule],
                 recovery_actions: list[RecoveryActionEntry] | None = None):
        self.xids = xids
        self.kinds = kinds
        self.nvlink5 = nvlink5
        self.recovery_actions = list(recovery_actions or [])

    def recovery_action(self, text: str | None = None, nvml: int | None = None) -> RecoveryActionEntry | None:
        """The GPU recovery action meant by the driver's `text` (first row whose words all appear, case
        folded) or by its NVML value. None when no row matches."""
        if nvml is not None:
            return next((a for a in self.recovery_actions if a.nvml == nvml), None)
        low = (text or "").lower()
        return next((a for a in self.recovery_actions if a.words and all(w in low for w in a.words)), None)

    def xid(self, n: int) -> XidEntry:
        """The catalog entry for XID `n`. Raises KeyError (message names the known range)."""
        try:
            return self.xids[n]
        except KeyError:
            raise KeyError(f"XID {n} is not in the catalog (known: {min(self.xids)}..{max(self.xids)})") from None

    def kind(self, name: str) -> KindEntry:
        """The `kinds.toml` entry `name`. Raises KeyError listing nothing more than the name."""
        try:
            return self.kinds[name]
        except KeyError:
            raise KeyError(f"kind {name!r} is not in the catalog") from None

    def decode_nvlink5(
        self,
        xid: int,
        intrinfo: int,
        error_status: int,
        driver_version: str | None = None,
        unit_hint: str | None = None,
    ) -> Nvlink5Decode | None:
        """Decode an XID 144-150 report with the 'Xid 144-150 Decode' rules.

        Args:
            xid: 144..150.
            intrinfo: the first register word printed (32 bits).
            error_status: the second register word (32 bits).
            driver_version: e.g. "575.51.02"; < 575 uses v1 patterns, >= 575 v2; None tries both.
            unit_hint: the unit name the driver printed (e.g. "NETIR", "RLW_RXPIPE"); breaks ties.
        Returns:
            `Nvlink5Decode`, or None when no rule's intrinfo pattern fits. A unit that fits but whose
            error status has no rule decodes with `resolution=None` and severity from the unit's worst
            rule being unknown -> degraded.
        Rule: error status equal to the rule's value first; otherwise any rule whose (single-bit) value
        is set in the status; the most severe candidate wins; a candidate whose unit matches
        `unit_hint` beats one that doesn't.
        """
        major = _driver_major(driver_version)
        versions = ["v1", "v2"] if major is None else (["v2"] if major >= 575 else ["v1"])
        cands = [(r, v) for r in self.nvlink5 if r.xid == xid for v in versions if r.matches(intrinfo, v)]
        if not cands:
            return None
        if unit_hint:
            hinted = [c for c in cands if unit_hint.upper() in c[0].unit.upper().split("/")]
            cands = hinted or cands
        pool = [c for c in cands if c[0].error_status == error_status]
        if not pool:
            pool = [c for c in cands if c[0].error_status and (c[0].error_status & error_status)]
        if not pool:
            rule, ver = cands[0]
            return Nvlink5Decode(
                unit=rule.unit, severity=Severity.DEGRADED, resolution=None, investigatory=None,
                hw_sw=None, pattern_version=ver, source=rule.source,
            )
        rule, ver = max(pool, key=lambda c: (c[0].fatal, c[0].resolution is Action.RESET_GPU))
        return Nvlink5Decode(
            unit=rule.unit,
            severity=Severity.FATAL if rule.fatal else Severity.DEGRADED,
            resolution=rule.resolution,
            investigatory=rule.investigatory,
            hw_sw=rule.hw_sw,
            pattern_version=ver,
            source=rule.source,
        )

    def classify(self, event: FaultEvent) -> Classification:
        """Classify one event by `kind` (+ `code` for XIDs).

        Args:
            event: any `FaultEvent`. XID events (`kind == "xid"`) use `code`; XID 144-150 read
                `attrs["intrinfo"]`, `attrs["error_status"]` (int or hex str), optional
                `attrs["unit"]`, `attrs["driver_version"]`, `attrs["fatal_word"]` ("Fatal"/"Nonfatal");
                XID 154 reads `attrs["recovery_action"]`.
        Returns:
            `Classification`. Healthy (clearing) events are info with action IGNORE; the parser emits
            them under the kind they clear (same `fault_key`), naming the clearing kind in
            `attrs["clearing_kind"]`. A kind or XID not in the catalog
            keeps the event's own severity with action NONE and source "not in catalog".
        """
        if event.kind == "xid" and event.code is not None:
            return self._classify_xid(event)
        entry = self.kinds.get(event.kind)
        if entry is None:
            return Classification(
                severity=Severity.INFO if event.healthy else event.severity,
                immediate_action=Action.NONE,
                investigatory_action="(none)",
                source="not in catalog",
                fault_class=event.kind,
                description=event.message or event.kind,
                drain=False,
                component=event.component,
            )
        if event.healthy and not entry.healthy:
            return Classification(
                severity=Severity.INFO,
                immediate_action=Action.IGNORE,
                investigatory_action="(none)",
                source=entry.source,
                fault_class=entry.name,
                description=f"cleared: {entry.description}",
                drain=False,
                component=entry.component,
            )
        severity, drain = entry.severity, entry.drain
        if entry.follows_recovery_action:
            action = str(event.attrs.get("recovery_action", ""))
            act = self.recovery_action(action)  # recovery_actions.toml, as for XID 154
            if act is not None and act.severity is not Severity.INFO:
                severity, drain = act.severity, act.drain
        return Classification(
            severity=Severity.INFO if event.healthy or entry.healthy else severity,
            immediate_action=entry.immediate_action,
            investigatory_action=entry.investigatory_action,
            source=entry.source,
            fault_class=entry.name,
            description=entry.description,
            drain=drain and not event.healthy,
            component=entry.component,
        )

    def clearable(self, event: FaultEvent) -> bool:
        """Whether the event's kind has a clearing event (`cleared_by` names a kind, not 'none: …');
        XIDs never do. Clearable faults are debounced (policy `debounce_s`) before they drain."""
        if event.kind == "xid":
            return False
        entry = self.kinds.get(event.kind)
        return entry is not None and not entry.cleared_by.startswith("none:")

    def stamp(self, event: FaultEvent, *, keep_severity: bool = True,
              classification: Classification | None = None) -> FaultEvent:
        """The event with its `Verdict`: how every producer classifies, once, when it builds an event.

        Args:
            keep_severity: keep the event's own `severity` (the probe's reading); False sets it to the
                verdict's.
            classification: `classify(event)` when the caller already has it (not computed twice).
        """
        v = self.verdict(event, classification)
        update: dict[str, Any] = {"verdict": v}
        if not keep_severity:
            update["severity"] = v.severity
        return event.model_copy(update=update)

    def verdict(self, event: FaultEvent, classification: Classification | None = None) -> Verdict:
        """`classify` plus the row's urgency, recovery, verification checks and history rule: the
        `Verdict` that travels with the event to the workflow. Unknown kinds: diagnose, every check."""
        c = classification or self.classify(event)
        row: XidEntry | KindEntry | None = (self.xids.get(event.code) if event.kind == "xid" and event.code is not None
                                           else self.kinds.get(event.kind))
        extra = {} if row is None else dict(urgency=row.urgency, recovery=row.recovery, verify=list(row.verify),
                                            history=row.history)
        return Verdict(severity=c.severity, immediate_action=c.immediate_action.value,
                       investigatory_action=c.investigatory_action or "", fault_class=c.fault_class,
                       drain=c.drain, source=c.source or "", description=c.description or "",
                       clearable=self.clearable(event), **extra)

    def _classify_xid(self, event: FaultEvent) -> Classification:
        n = int(event.code)  # type: ignore[arg-type]
        entry = self.xids.get(n)
        if entry is None:
            return Classification(
                severity=Severity.DEGRADED,
                immediate_action=Action.CONTACT_SUPPORT,
                investigatory_action="(none)",
                source="not in catalog (unknown XID)",
                fault_class=f"xid{n}",
                description=f"XID {n} (not in the catalog)",
                drain=False,
                component=Component.GPU,
            )
        severity, drain = entry.base_severity, bool(entry.drain)
        resolution: Action | None = None
        unit: str | None = None
        source = entry.source
        investigatory = entry.investigatory_action
        if entry.immediate_action is Action.WORKFLOW_NVLINK5_ERR and entry.severity is None:
            decoded = None
            intrinfo, status = _int_attr(event.attrs.get("intrinfo")), _int_attr(event.attrs.get("error_status"))
            if intrinfo is not None and status is not None:
                hint = event.attrs.get("unit")
                decoded = self.decode_nvlink5(
                    n, intrinfo, status,
                    driver_version=_str_or_none(event.attrs.get("driver_version")),
                    unit_hint=hint if isinstance(hint, str) else None,
                )
            if decoded is not None and decoded.resolution is not None:
                severity = decoded.severity
                resolution, unit = decoded.resolution, decoded.unit
                investigatory = decoded.investigatory or investigatory
                source = f"{decoded.source} (rule {decoded.pattern_version}: {decoded.unit})"
            else:
                word = str(event.attrs.get("fatal_word", "")).lower()
                severity = Severity.FATAL if word == "fatal" else Severity.DEGRADED
                unit = decoded.unit if decoded else None
            if entry.drain is None:
                drain = severity is Severity.FATAL
        elif entry.immediate_action is Action.XID_154 and entry.severity is None:
            act = self.recovery_action(str(event.attrs.get("recovery_action", "")))
            if act is not None and act.severity is not Severity.INFO:
                severity, drain = act.severity, act.drain if entry.drain is None else entry.drain
        return Classification(
            severity=severity,
            immediate_action=entry.immediate_action,
            investigatory_action=investigatory,
            source=source,
            fault_class=f"xid{n}",
            description=f"{entry.mnemonic}: {entry.description}",
            drain=drain,
            component=entry.component,
            resolution=resolution,
            unit=unit,
        )


def _int_attr(v: Any) -> int | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, int):
        return v
    try:
        return int(str(v), 0)
    except ValueError:
        return None


def _str_or_none(v: Any) -> str | None:
    return None if v is None else str(v)


def _read_toml(text: str, where: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise CatalogError(f"{where}: not valid TOML: {err}") from err


def _build(model: type[BaseModel], data: dict[str, Any], where: str) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(entry)'}: {e['msg']}" for e in err.errors())
        raise CatalogError(f"{where}: {problems}") from err


def _merge_overrides(
    xid_raw: dict[int, dict[str, Any]], kind_raw: dict[str, dict[str, Any]], path: Path
) -> None:
    try:
        data = _read_toml(path.read_text(encoding="utf-8"), str(path))
    except FileNotFoundError as err:
        raise CatalogError(f"catalog overrides file {path} not found") from err
    unknown = set(data) - {"xid", "kind"}
    if unknown:
        raise CatalogError(f"{path}: unknown section(s) {sorted(unknown)}; expected xid, kind")
    for key, fields in data.get("xid", {}).items():
        if not isinstance(fields, dict) or not str(key).isdigit():
            raise CatalogError(f"{path}: [xid.{key}]: expected a table keyed by the XID number")
        xid_raw.setdefault(int(key), {"xid": int(key)}).update(fields)
    for key, fields in data.get("kind", {}).items():
        if not isinstance(fields, dict):
            raise CatalogError(f"{path}: [kind.{key}]: expected a table")
        kind_raw.setdefault(key, {"name": key}).update(fields)


def load_catalog(overrides: Path | None = None) -> Catalog:
    """Load and validate the packaged catalog, then apply operator overrides.

    Args:
        overrides: optional TOML with `[xid.N]` / `[kind.NAME]` tables; each key replaces the packaged
            value (a new entry must give every required field).
    Returns:
        `Catalog`.
    Raises:
        CatalogError: invalid TOML, unknown section or key, bad value; the message names the file and
            the entry (`xid.toml: [xid.79]: immediate_action: Input should be ...`).
    """
    pkg = resources.files(__name__)
    xid_data = _read_toml(pkg.joinpath("xid.toml").read_text(encoding="utf-8"), "xid.toml")
    kind_data = _read_toml(pkg.joinpath("kinds.toml").read_text(encoding="utf-8"), "kinds.toml")
    nv_data = _read_toml(pkg.joinpath("nvlink5.toml").read_text(encoding="utf-8"), "nvlink5.toml")
    ra_data = _read_toml(pkg.joinpath("recovery_actions.toml").read_text(encoding="utf-8"), "recovery_actions.toml")

    xid_raw = {int(k): {"xid": int(k), **v} for k, v in xid_data.get("xid", {}).items()}
    kind_raw = {k: {"name": k, **v} for k, v in kind_data.get("kind", {}).items()}
    where_x = {n: "xid.toml" for n in xid_raw}
    where_k = {k: "kinds.toml" for k in kind_raw}
    if overrides is not None:
        before_x = {n: dict(v) for n, v in xid_raw.items()}
        before_k = {k: dict(v) for k, v in kind_raw.items()}
        _merge_overrides(xid_raw, kind_raw, Path(overrides))
        where_x.update({n: str(overrides) for n in xid_raw if before_x.get(n) != xid_raw[n]})
        where_k.update({k: str(overrides) for k in kind_raw if before_k.get(k) != kind_raw[k]})

    xids = {n: _build(XidEntry, d, f"{where_x[n]}: [xid.{n}]") for n, d in sorted(xid_raw.items())}
    kinds = {k: _build(KindEntry, d, f"{where_k[k]}: [kind.{k}]") for k, d in kind_raw.items()}
    rules = [_build(Nvlink5Rule, d, f"nvlink5.toml: rule #{i}") for i, d in enumerate(nv_data.get("rule", []))]
    for name, entry in kinds.items():
        for cleared in entry.clears:
            if cleared not in kinds:
                raise CatalogError(f"{where_k[name]}: [kind.{name}]: clears unknown kind {cleared!r}")
        if not entry.cleared_by.startswith("none:") and entry.cleared_by not in kinds:
            raise CatalogError(f"{where_k[name]}: [kind.{name}]: cleared_by unknown kind {entry.cleared_by!r}")
        if entry.escalate_to is not None and (
            entry.escalate_to not in kinds or not entry.escalate_count or not entry.escalate_window_s
            or not entry.escalate_reason
        ):
            raise CatalogError(f"{where_k[name]}: [kind.{name}]: escalate_to needs a known kind, "
                               "escalate_count, escalate_window_s and escalate_reason")
    actions = [_build(RecoveryActionEntry, {"name": k, **v}, f"recovery_actions.toml: [action.{k}]")
               for k, v in ra_data.get("action", {}).items()]
    return Catalog(xids, kinds, rules, actions)


@lru_cache(maxsize=1)
def default_catalog() -> Catalog:
    """The packaged catalog without overrides, loaded once per process."""
    return load_catalog()
