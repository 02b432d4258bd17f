"""`SlurmScheduler`: drain and RESUME a node with `scontrol` (one `SchedulerAdapter`); expand a Slurm
hostlist or a job's nodes for `fleetmend sweep` (`SlurmScheduler.expand`, `.job_nodes`, `expand_hostlist`).

`scontrol update NodeName=<n> State=DRAIN Reason="<prefix> <reason> [incident <id>]"`, ownership by the
reason prefix (`SlurmSettings.reason_prefix`, default `fleetmend:`): only a drain whose reason carries
it is ever resumed. Verified against Slurm 22.05.8.

Node state is read with `scontrol --json show node` where the Slurm version has it (23.02 and later;
`parse_scontrol_json`), and from `scontrol -o show node` text otherwise (`parse_scontrol_node`): the
first refusal of `--json` ("unrecognized option") is remembered per adapter and the text form used
from then on. Both give the same fields (`NodeName`, `State` as `IDLE+DRAIN`, `Reason`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil

from fleetmend.config import SlurmSettings
from fleetmend.errors import NodeNotFoundError, SchedulerError
from fleetmend.messages import OWNER_FLEETMEND, OWNER_OPERATOR, DrainResult, NodeInfo, UndrainResult

_REASON_SUFFIX = re.compile(r"\s*\[[^\[\]@]*@[^\[\]]*\]\s*$")
_INCIDENT = re.compile(r"\[incident ([^\]]+)\]")
_KEY_SPLIT = re.compile(r"\s+(?=[A-Za-z][A-Za-z0-9_:/]*=)")


def parse_scontrol_node(text: str) -> dict[str, str]:
    """Parse one `scontrol -o show node X` line into its Key=Value fields.

    Values may hold spaces (`OS=Linux 6.18 #1 SMP …`); `Reason=` is always last in 22.05 and runs
    to the end of the line (it may contain `=` and brackets), so it is cut off before splitting.

    Args:
        text: the line (leading/trailing whitespace ignored).
    Returns:
        dict of field → value, e.g. `{"NodeName": "node3", "State": "IDLE+DRAIN",
        "Reason": "fleetmend: xid 79 [incident i-1] [root@2026-11-29T14:50:26]"}`.
    """
    line = text.strip().splitlines()[0] if text.strip() else ""
    fields: dict[str, str] = {}
    idx = line.find(" Reason=")
    if idx >= 0:
        fields["Reason"] = line[idx + len(" Reason="):].strip()
        line = line[:idx]
    for token in _KEY_SPLIT.split(line):
        key, sep, value = token.partition("=")
        if sep:
            fields[key] = value.strip()
    return fields


def parse_scontrol_job(line: str) -> dict[str, str]:
    """Parse one `scontrol -o show job` line into its Key=Value fields (`JobId`, `JobState`, `NodeList`,
    …). Unlike a node's, a job's `Reason=` is one word in the middle of the line (`Reason=None`)."""
    fields: dict[str, str] = {}
    for token in _KEY_SPLIT.split(line.strip()):
        key, sep, value = token.partition("=")
        if sep:
            fields.setdefault(key, value.strip())
    return fields


def parse_scontrol_json(text: str) -> list[dict[str, str]]:
    """Parse `scontrol --json show node [X]` (Slurm >= 23.02, the data_parser's `nodes` list) into the
    fields `parse_scontrol_node` gives for each node.

    `state` is a list of words in 23.02+ (`["IDLE", "DRAIN"]`) and a word plus `state_flags` in the
    older REST shape (`"idle"`, `["DRAIN"]`); both become `IDLE+DRAIN`. `NOT_RESPONDING` becomes the
    text form's trailing `*` (`DOWN*`). The JSON reason carries no `[user@time]` suffix.

    Returns:
        one dict per node: `NodeName`, `State`, `Reason`, `NodeHostName`, `NodeAddr`.
    Raises:
        ValueError: not JSON, or no `nodes` list.
    """
    doc = json.loads(text)
    nodes = doc.get("nodes") if isinstance(doc, dict) else None
    if not isinstance(nodes, list):
        raise ValueError("scontrol --json output without a nodes list")
    out = []
    for n in nodes:
        state = n.get("state")
        words = [str(w).upper() for w in (state if isinstance(state, list) else [state] if state else [])]
        words += [str(w).upper() for w in n.get("state_flags") or []]
        star = "NOT_RESPONDING" in words
        words = [w for w in words if w != "NOT_RESPONDING"]
        reason = n.get("reason") or ""
        out.append({"NodeName": str(n.get("name") or ""), "State": "+".join(words) + ("*" if star else ""),
                    "Reason": reason if isinstance(reason, str) else str(reason),
                    "NodeHostName": str(n.get("hostname") or ""), "NodeAddr": str(n.get("address") or "")})
    return out


def strip_reason_suffix(reason: str) -> str:
    """`"maint x [root@2026-11-29T14:50:26]"` → `"maint x"` (Slurm appends who and when)."""
    return _REASON_SUFFIX.sub("", reason or "").strip()


def normalize_slurm_state(raw: str) -> str:
    """scontrol's State → sinfo's long word: `IDLE+DRAIN` → drained, `ALLOCATED+DRAIN` → draining,
    `DOWN*` → down*, `MIXED` → mixed. Flags other than DRAIN (e.g. `+COMPLETING`) are dropped."""
    if not raw:
        return "unknown"
    not_responding = "*" in raw
    parts = raw.replace("*", "").split("+")
    base, flags = parts[0].lower(), {p.upper() for p in parts[1:]}
    if "DRAIN" in flags:
        if base in ("allocated", "mixed", "completing") or "COMPLETING" in flags:
            word = "draining"
        else:
            word = "drained"
    else:
        word = base
    return word + ("*" if not_responding else "")


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm hostlist expression; order kept, duplicates dropped. What `scontrol show hostnames`
    does, for hosts without Slurm: `"gpu[01-03,07],cpu1"` → `["gpu01", "gpu02", "gpu03", "gpu07", "cpu1"]`
    (comma-separated at the top level, bracket ranges with zero padding kept, several bracket groups
    per name). The expansion is python-hostlist's (`hostlist.expand_hostlist`, NSC's implementation of
    Slurm's syntax, ranges capped at its `MAX_SIZE`).

    Raises:
        ValueError: unbalanced brackets, a range that is not `N` or `N-M`, one that runs backwards or
            is too large (the message is python-hostlist's, with the expression).
    """
    import hostlist  # python-hostlist (control-plane set); imported here: `fleetmend sweep` alone needs it

    try:
        return list(hostlist.expand_hostlist(text))
    except hostlist.BadHostlist as err:
        raise ValueError(f"bad hostlist {text!r}: {err}") from err


def _is_drained(raw: str) -> bool:
    parts = {p for p in raw.replace("*", "").split("+")}
    return bool(parts & {"DRAIN", "DRAINED", "DRAINING", "DOWN", "FAIL", "FAILING"})


class SlurmScheduler:
    """Drain and RESUME through `scontrol` (asyncio subprocesses, never a shell).

    Args:
        settings: `SlurmSettings` (binaries, SLURM_CONF, `reason_prefix`, `command_timeout_s`).
    """

    name = "slurm"

    def __init__(self, settings: SlurmSettings) -> None:
        self.settings = settings
        self.prefix = settings.reason_prefix.strip()
        self.env = dict(os.environ)
        if settings.slurm_conf:
            self.env["SLURM_CONF"] = settings.slurm_conf
        self.update_calls = 0
        """How many `scontrol update` commands this instance ran (visible idempotency)."""
        self.json_supported: bool | None = None
        """Whether this scontrol has `--json` (None until the first show)."""

    # -- subprocess plumbing -------------------------------------------------------------------

    def _where(self) -> str:
        return f"{self.settings.scontrol} (SLURM_CONF={self.env.get('SLURM_CONF', 'default /etc/slurm/slurm.conf')})"

    async def _run(self, *argv: str) -> tuple[int, str, str]:
        try:
            async with asyncio.timeout(self.settings.command_timeout_s):
                proc = await asyncio.create_subprocess_exec(
                    *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=self.env)
                try:
                    out, errout = await proc.communicate()
                except asyncio.CancelledError:
                    if proc.returncode is None:
                        proc.kill()
                        await proc.wait()
                    raise
        except TimeoutError as err:
            raise SchedulerError(
                f"{' '.join(argv)} did not finish within {self.settings.command_timeout_s}s; "
                f"is slurmctld reachable? ({self._where()})") from err
        except FileNotFoundError as err:
            raise SchedulerError(f"{argv[0]} not found; set slurm.scontrol/slurm.sinfo or install slurm-client") from err
        return proc.returncode or 0, out.decode(errors="replace"), errout.decode(errors="replace")

    @staticmethod
    def _one_node(node: str) -> None:
        """Refuse a name scontrol would expand to several nodes (`gpu[01-64]`, `a,b`): one incident
        drains one node under one FleetGuard permit.

        Raises:
            NodeNotFoundError: `node` holds `[`, `]` or `,` (Slurm hostlist syntax).
        """
        if any(ch in node for ch in "[],"):
            raise NodeNotFoundError(f"node {node!r} is a Slurm hostlist expression, not one node; refused")

    async def _show_json(self, *node: str) -> list[dict[str, str]] | None:
        """`scontrol --json show node [node]` parsed, or None when this scontrol has no `--json`
        (remembered) or the JSON answer is not a usable node list (the text form then answers,
        with its own errors for an unknown node)."""
        if self.json_supported is False:
            return None
        rc, out, err = await self._run(self.settings.scontrol, "--json", "show", "node", *node)
        if rc != 0 and "unrecognized option" in (err or out).lower():
            self.json_supported = False
            return None
        try:
            rows = parse_scontrol_json(out) if rc == 0 else None
        except ValueError:
            rows = None
        if rows is not None:
            self.json_supported = True
        if not rows or (node and rows[0]["NodeName"] != node[0]):
            return None
        return rows

    async def show(self, node: str) -> dict[str, str]:
        """`node`'s fields: `scontrol --json show node <node>` where supported (`parse_scontrol_json`),
        else `scontrol -o show node <node>` (`parse_scontrol_node`).

        Raises:
            NodeNotFoundError: slurmctld does not know `node`, or `node` names several nodes.
            SchedulerError: scontrol failed otherwise (stderr in the message).
        """
        self._one_node(node)
        rows = await self._show_json(node)
        if rows:
            return rows[0]
        rc, out, err = await self._run(self.settings.scontrol, "-o", "show", "node", node)
        if rc != 0 or not out.strip():
            text = (err or out).strip()
            if "not found" in text.lower():
                raise NodeNotFoundError(f"node {node!r} not found by {self._where()}: {text}")
            raise SchedulerError(f"scontrol show node {node} failed (rc {rc}): {text} [{self._where()}]")
        return parse_scontrol_node(out)

    async def _update(self, node: str, *fields: str) -> None:
        self._one_node(node)
        self.update_calls += 1
        rc, out, err = await self._run(self.settings.scontrol, "update", f"NodeName={node}", *fields)
        if rc != 0:
            text = (err or out).strip()
            if "invalid node name" in text.lower():
                raise NodeNotFoundError(f"node {node!r} not found by {self._where()}: {text}")
            raise SchedulerError(
                f"scontrol update NodeName={node} {' '.join(fields)} failed (rc {rc}): {text} [{self._where()}]")

    def _owned(self, reason: str) -> bool:
        return bool(self.prefix) and reason.startswith(self.prefix)

    def format_reason(self, reason: str, incident_id: str) -> str:
        """`"<prefix> <reason> [incident <id>]"`, on one line, without quotes (Slurm stores it verbatim)."""
        clean = " ".join(reason.replace('"', "'").split())[:200]
        return f"{self.prefix} {clean} [incident {incident_id}]"

    # -- adapter API ---------------------------------------------------------------------------

    async def state(self, node: str) -> str:
        """Normalized state of `node` (idle, draining, drained, down*, …). Raises NodeNotFoundError."""
        return normalize_slurm_state((await self.show(node)).get("State", ""))

    async def drain(self, node: str, reason: str, incident_id: str) -> DrainResult:
        """Drain `node` unless it is already drained or down.

        Args:
            node: Slurm NodeName.
            reason: why (e.g. "xid 79 GPU fell off the bus"); stored after the prefix.
            incident_id: recorded in the reason as `[incident <id>]`.
        Returns:
            `DrainResult`. Already drained by fleetmend → owned=True with no second update; drained or
            DOWN by someone else → operator_drained=True, owned=False, untouched.
        Raises:
            NodeNotFoundError: unknown node.
            SchedulerError: scontrol failed or timed out.
        """
        fields = await self.show(node)
        raw = fields.get("State", "")
        current = strip_reason_suffix(fields.get("Reason", ""))
        if _is_drained(raw):
            if self._owned(current):
                m = _INCIDENT.search(current)
                if m and m.group(1) != incident_id:
                    # an earlier incident's drain of this node (that incident is over: one runs per node at a
                    # time): adopted, so that only this incident's undrain may lift it
                    await self._update(node, "State=DRAIN", f"Reason={self.format_reason(reason, incident_id)}")
                    now = strip_reason_suffix((await self.show(node)).get("Reason", ""))
                    return DrainResult(node, True, True, False, normalize_slurm_state(raw),
                                       f"already drained by fleetmend incident {m.group(1)}; adopted by this incident",
                                       reason=now, raw_state=raw)
                return DrainResult(node, True, True, False, normalize_slurm_state(raw),
                                   f"already drained by fleetmend ({current!r}); no update sent",
                                   reason=current, raw_state=raw)
            return DrainResult(node, True, False, True, normalize_slurm_state(raw),
                               f"already {raw} by someone else (reason {current!r}); left as is, "
                               "fleetmend will not resume it", reason=current, raw_state=raw)
        await self._update(node, "State=DRAIN", f"Reason={self.format_reason(reason, incident_id)}")
        after = await self.show(node)
        raw = after.get("State", "")
        now_reason = strip_reason_suffix(after.get("Reason", ""))
        owned = self._owned(now_reason)
        return DrainResult(node, _is_drained(raw), owned, _is_drained(raw) and not owned,
                           normalize_slurm_state(raw),
                           f"scontrol State=DRAIN set; now {raw}" if owned else
                           f"drain raced with another writer: reason now {now_reason!r}",
                           reason=now_reason, raw_state=raw)

    async def undrain(self, node: str, incident_id: str) -> UndrainResult:
        """RESUME `node` if, and only if, its drain reason carries our prefix and names `incident_id`
        (a reason without an incident, from an older version, is resumed too).

        Returns:
            `UndrainResult`: resumed=True after `State=RESUME`; resumed=False (a success) when the node
            was not drained; resumed=False with operator_drained=True when the drain is someone else's.
        Raises:
            NodeNotFoundError, SchedulerError: as `drain`.
        """
        fields = await self.show(node)
        raw = fields.get("State", "")
        current = strip_reason_suffix(fields.get("Reason", ""))
        if not _is_drained(raw):
            return UndrainResult(node, False, normalize_slurm_state(raw), f"not drained ({raw}); nothing to resume")
        if not self._owned(current):
            return UndrainResult(node, False, normalize_slurm_state(raw),
                                 f"drain is not fleetmend's: reason {current!r} lacks prefix {self.prefix!r}; "
                                 "left for the operator", operator_drained=True)
        m = _INCIDENT.search(current)
        if m and m.group(1) != incident_id:
            return UndrainResult(node, False, normalize_slurm_state(raw),
                                 f"the drain belongs to incident {m.group(1)}, not {incident_id}; left as is")
        await self._update(node, "State=RESUME")
        raw_after = (await self.show(node)).get("State", "")
        return UndrainResult(node, True, normalize_slurm_state(raw_after), f"scontrol State=RESUME; now {raw_after}")

    async def list_nodes(self) -> list[NodeInfo]:
        """Every node slurmctld knows (`scontrol --json show node`, else `-o`), with state, reason and owner.

        Raises:
            SchedulerError: scontrol failed.
        """
        parsed = await self._show_json()
        if parsed is None:
            rc, out, err = await self._run(self.settings.scontrol, "-o", "show", "node")
            if rc != 0:
                raise SchedulerError(f"scontrol show node failed (rc {rc}): {(err or out).strip()} [{self._where()}]")
            parsed = [parse_scontrol_node(line) for line in out.splitlines() if line.startswith("NodeName=")]
        rows = []
        for f in parsed:
            raw, reason = f.get("State", ""), strip_reason_suffix(f.get("Reason", ""))
            owner = None
            if _is_drained(raw):
                owner = OWNER_FLEETMEND if self._owned(reason) else OWNER_OPERATOR
            m = _INCIDENT.search(reason) if owner == OWNER_FLEETMEND else None
            rows.append(NodeInfo(f.get("NodeName", "?"), normalize_slurm_state(raw), reason, owner,
                                 m.group(1) if m else None))
        return rows

    # -- hostlists (for `fleetmend sweep`) ------------------------------------------------------

    async def expand(self, expr: str) -> list[str]:
        """The nodes a Slurm hostlist names (`gpu[01-64]`): `scontrol show hostnames` when scontrol is
        installed, else (or when it refuses the expression) `expand_hostlist`.

        Raises:
            ValueError: an expression neither accepts.
            SchedulerError: scontrol did not finish within `command_timeout_s`.
        """
        if shutil.which(self.settings.scontrol):
            rc, out, _ = await self._run(self.settings.scontrol, "show", "hostnames", expr)
            if rc == 0 and out.strip():
                return out.split()
        return expand_hostlist(expr)

    async def running_jobs(self) -> dict[str, list[str]]:
        """Every running job's nodes (`scontrol -o show job`: one line per job, `JobState=RUNNING`,
        `NodeList=` expanded by `expand_hostlist`, else by `scontrol show hostnames`): the fail-slow
        analyzer compares the nodes of one job together, whether or not every rank reports its step
        times (`fleetmend.worker.analyzer_link`). A job whose node list cannot be expanded is left out.

        Raises:
            SchedulerError: scontrol missing, failing or timed out."""
        if not shutil.which(self.settings.scontrol):
            raise SchedulerError(f"Slurm's {self.settings.scontrol} is not on PATH (slurm.scontrol): "
                                 "running jobs come from scontrol")
        rc, out, err = await self._run(self.settings.scontrol, "-o", "show", "job")
        if rc != 0:
            if "no jobs in the system" in (err or out).lower():
                return {}
            raise SchedulerError(f"scontrol -o show job failed (rc {rc}): {(err or out).strip()} [{self._where()}]")
        jobs: dict[str, list[str]] = {}
        for line in out.splitlines():
            f = parse_scontrol_job(line) if line.startswith("JobId=") else {}
            if f.get("JobState") != "RUNNING" or f.get("NodeList") in (None, "", "(null)"):
                continue
            try:
                nodes = expand_hostlist(f["NodeList"])
            except ValueError:
                try:
                    nodes = await self.expand(f["NodeList"])
                except (ValueError, SchedulerError):
                    continue
            jobs[f["JobId"]] = nodes
        return jobs

    async def job_nodes(self, job: str) -> list[str]:
        """The nodes of a running Slurm job (`scontrol show job JOBID`, field `NodeList=`, expanded by
        `expand`).

        Raises:
            SchedulerError: scontrol missing or timed out, an unknown job, or a job without nodes (pending).
        """
        if not shutil.which(self.settings.scontrol):
            raise SchedulerError(f"Slurm's {self.settings.scontrol} is not on PATH (slurm.scontrol): "
                                 "a job's nodes come from scontrol")
        rc, out, err = await self._run(self.settings.scontrol, "show", "job", job)
        if rc != 0:
            raise SchedulerError(f"scontrol show job {job}: {(err or out).strip()}")
        m = re.search(r"(?:^|\s)NodeList=(\S+)", out)
        if not m or m.group(1) in ("(null)", ""):
            raise SchedulerError(f"job {job} has no nodes allocated (pending?)")
        return await self.expand(m.group(1))
