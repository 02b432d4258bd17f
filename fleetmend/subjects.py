"""Every NATS subject, JetStream name and Temporal id comes from a function here.

Call sites never build them with f-strings, so a rename is one edit and the node-scoped
permissions in `deploy/nats/` stay in step with the code.

Node names are used as they are everywhere a string may hold them (workflow ids, CLI, logs, ticket
fields, Kubernetes and Slurm calls) and pass through `node_token` wherever NATS limits the
characters: subject tokens, inbox prefixes and JetStream KV keys. `node_token` / `token_node` are
the one encoding pair; nothing else encodes or decodes node names.
"""

from __future__ import annotations

import re

FAULT_STREAM = "FLEET_FAULTS"
"""JetStream stream holding fault events (file storage, dedupe window by Nats-Msg-Id)."""
DEADLETTER_STREAM = "FLEET_DEADLETTER"
DEADLETTER_SUBJECT = "fleet.deadletter"
ROUTER_DURABLE = "fleetmend-router"
DRAIN_KV_BUCKET = "fleetmend_drains"
"""JetStream key-value bucket of the standalone scheduler adapter (drained set, durable)."""
TICKET_KV_BUCKET = "fleetmend_tickets"
LEASE_KV_BUCKET = "fleetmend_leases"
"""Leases electing the one replica that publishes a cluster's fleet-level gauges (`fleetmend.infra.lease`)."""
PERMIT_KV_BUCKET = "fleetmend_permits"
"""The drain-permit pool (`fleetmend.infra.permit_pool`): one key per cluster, the budget's holders."""
NOTIFY_KV_BUCKET = "fleetmend_notified"
"""Notifications already delivered, by deduplication key and channel (a retried activity skips them)."""
PERF_STREAM = "FLEET_PERF"
"""JetStream stream of performance telemetry (`fleetmend.telemetry`): short max age, file storage."""
JOB_STREAM = "FLEET_JOBS"
"""JetStream stream of job step timings (`fleetmend.jobs`): short max age, file storage."""
ANALYZER_KV_BUCKET = "fleetmend_analyzer"
FINGERPRINT_KV_BUCKET = "fleetmend_fingerprints"
"""Latest `fingerprint.Fingerprint` per node, key `fingerprint_kv_key(cluster, node)`."""
FINGERPRINT_STREAM = "FLEET_FINGERPRINTS"
"""`FingerprintChange` records on `fleet.*.fingerprint.*`: who changed what, when."""
DRIFT_ALLOW_KV_BUCKET = "fleetmend_drift_allow"
"""Allowed value sets per fact key (`fleetmend drift allow`), key `drift_allow_kv_key(cluster, fact)`."""
LEDGER_KV_BUCKET = "fleetmend_ledger"
"""The incident ledger (`fleetmend.ledger`, `fleetmend.infra.ledger`): one record per drained incident, kept
`ledger.max_age_days` (beyond Temporal's retention). Keys: `ledger_open_key`, `ledger_closed_key`,
`ledger_pack_key` (closed records rolled up many per value), `ledger_route_key`, `ledger_part_key`."""
"""KV bucket of the fail-slow analyzer: `lease.<cluster>` (active replica) and `state.<cluster>`."""

_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
"""Cluster names: one plain token everywhere (subjects, KV keys, workflow ids, metric labels)."""

NODE_NAME_MAX = 253
"""Longest node name accepted: a Kubernetes node name is an RFC 1123 subdomain of at most 253 characters."""

_TOKEN_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_TOKEN = re.compile(r"^(?:[A-Za-z0-9_-]|=[0-9A-F]{2})+$")
_COMMON_NODE = re.compile(r"[A-Za-z0-9._-]{1,253}\Z")


def _check(kind: str, value: str) -> str:
    if not _NAME.match(value or ""):
        raise ValueError(f"invalid {kind} name {value!r}: use letters, digits, '-' and '_' only")
    return value


def check_node_name(node: str) -> str:
    """Validate a node name as the operator and the scheduler spell it; returns it unchanged.

    Accepted: 1 to `NODE_NAME_MAX` bytes in UTF-8 (so `workflow_id` stays far below Temporal's 1,000-byte
    id limit; 253 emoji are 1,012 bytes), none of them whitespace, a control character, a path
    separator (`/`, `\\`: the name is a path component of credential files and of the workflow id
    `remediate/<cluster>/<node>`), a quote (`'`, `"`, a backtick: names are quoted inside Temporal
    visibility queries) or Slurm hostlist syntax (`[`, `]`, `,`: `scontrol update NodeName=gpu[01-64]`
    acts on every node the expression names, so one event would drain many nodes on one permit). That
    covers every Kubernetes node name (an RFC 1123 subdomain such as `ip-10-0-1-23.ec2.internal`) and
    every Slurm `NodeName` (`gpu.rack1-07`, `node_3`). The name itself is never put into a NATS subject
    or a KV key; `node_token` encodes it for those.

    Raises:
        ValueError: empty, too long, a whitespace/control character, a path separator, a quote or a
            hostlist character (the message says which).
    """
    if isinstance(node, str) and _COMMON_NODE.match(node) and node not in (".", ".."):
        return node  # the usual spelling (Kubernetes, Slurm): no per-character walk
    if not isinstance(node, str) or not node:
        raise ValueError(f"invalid node name {node!r}: empty")
    if len(node) > NODE_NAME_MAX or len(node.encode("utf-8")) > NODE_NAME_MAX:
        raise ValueError(f"invalid node name {node[:40]!r}...: {len(node)} characters, "
                         f"{len(node.encode('utf-8'))} bytes in UTF-8, at most {NODE_NAME_MAX} bytes (the "
                         "workflow id `remediate/<cluster>/<node>` must stay within Temporal's 1,000 bytes)")
    for ch in node:
        if ch.isspace() or not ch.isprintable():
            raise ValueError(f"invalid node name {node!r}: whitespace or control character {ch!r}")
        if ch in "/\\":
            raise ValueError(f"invalid node name {node!r}: path separator {ch!r}")
        if ch in "'\"`":
            raise ValueError(f"invalid node name {node!r}: quote {ch!r}")
        if ch in "[],":
            raise ValueError(f"invalid node name {node!r}: {ch!r} is Slurm hostlist syntax (a name of several "
                             "nodes); give one node")
    if node in (".", ".."):
        raise ValueError(f"invalid node name {node!r}: a directory name")
    return node


def node_token(node: str) -> str:
    """Encode a node name as one NATS subject token (and JetStream KV key part); `token_node` reverses it.

    Rule: letters, digits, `-` and `_` stay as they are; every other character becomes `=` followed
    by the two upper-case hex digits of each of its UTF-8 bytes (`.` -> `=2E`, `=` -> `=3D`). So
    `ip-10-0-1-23.ec2.internal` -> `ip-10-0-1-23=2Eec2=2Einternal`, and names made only of
    `[A-Za-z0-9_-]` are their own token (subjects, credentials and KV keys of such nodes are the same
    as before the encoding existed). Tokens never contain `.`, `*`, `>` or whitespace (NATS subject
    token rules) and use only `[A-Za-z0-9_=-]` (a subset of the JetStream KV key alphabet
    `[-/_=.a-zA-Z0-9]`). The mapping is one to one: every name has exactly one token.

    Raises:
        ValueError: the name fails `check_node_name`.
    """
    check_node_name(node)
    if all(ch in _TOKEN_SAFE for ch in node):
        return node
    out = []
    for ch in node:
        if ch in _TOKEN_SAFE:
            out.append(ch)
        else:
            out.extend(f"={b:02X}" for b in ch.encode("utf-8"))
    return "".join(out)


def token_node(token: str) -> str:
    """Decode a subject token made by `node_token` back to the node name.

    Only canonical tokens decode: `token_node(t)` succeeds exactly when `node_token(token_node(t)) == t`,
    so a subject cannot name a node in two spellings (the router's check that the event body's node
    is the subject's node relies on it).

    Raises:
        ValueError: a character outside `[A-Za-z0-9_=-]`, a malformed or lower-case `=XX` escape, an
            escape of a character that is never escaped, bytes that are not UTF-8, or a decoded name
            that fails `check_node_name`.
    """
    if not isinstance(token, str) or not _TOKEN.match(token):
        raise ValueError(f"invalid node token {token!r}: expected [A-Za-z0-9_-] and =XX escapes")
    if "=" not in token:
        return check_node_name(token)
    raw = bytearray()
    i = 0
    while i < len(token):
        if token[i] == "=":
            raw.append(int(token[i + 1:i + 3], 16))
            i += 3
        else:
            raw.extend(token[i].encode("ascii"))
            i += 1
    try:
        node = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"invalid node token {token!r}: escapes are not UTF-8 ({err.reason})") from None
    if node_token(node) != token:
        raise ValueError(f"invalid node token {token!r}: not canonical (the canonical spelling is "
                         f"{node_token(node)!r})")
    return node


def fault_subject(cluster: str, node: str) -> str:
    """`fleet.<cluster>.fault.<node token>`: where a node's agent publishes its `FaultEvent`s.

    The node part is `node_token(node)` (`ip-10-0-1-23.ec2.internal` → `ip-10-0-1-23=2Eec2=2Einternal`).
    Raises:
        ValueError: an invalid cluster or node name.
    """
    return f"fleet.{_check('cluster', cluster)}.fault.{node_token(node)}"


def heartbeat_subject(cluster: str, node: str) -> str:
    """`fleet.<cluster>.hb.<node token>`: core-NATS heartbeats (never stored in the fault stream)."""
    return f"fleet.{_check('cluster', cluster)}.hb.{node_token(node)}"


def diag_subject(cluster: str, node: str) -> str:
    """`fleet.<cluster>.diag.<node token>`: request/reply diagnostics answered by the node's agent."""
    return f"fleet.{_check('cluster', cluster)}.diag.{node_token(node)}"


def inbox_prefix(cluster: str, node: str) -> str:
    """`_INBOX.<cluster>.<node token>`: the reply-inbox prefix of a node's agent (its credentials
    allow subscribing only below it)."""
    return f"_INBOX.{_check('cluster', cluster)}.{node_token(node)}"


def permit_kv_key(cluster: str) -> str:
    """`<cluster>`: a cluster's key in the permit pool bucket (`PERMIT_KV_BUCKET`). Raises ValueError
    for an invalid cluster name."""
    return _check("cluster", cluster)


def permit_wait_kv_key(cluster: str, node: str) -> str:
    """`<cluster>.wait.<node token>`: in the permit pool bucket, a node the router refused a slot whose
    incident it is still starting (`fleetmend.infra.permit_pool.PermitPool.note_waiting`)."""
    return f"{_check('cluster', cluster)}.wait.{node_token(node)}"


def parse_permit_wait_kv_key(key: str) -> tuple[str, str]:
    """Inverse of `permit_wait_kv_key`: (cluster, node). Raises ValueError for other keys."""
    cluster, sep, token = key.partition(".wait.")
    if not sep or not cluster or not token:
        raise ValueError(f"not a permit wait key: {key!r}")
    return cluster, token_node(token)


def drain_kv_key(cluster: str, node: str) -> str:
    """`<cluster>.<node token>`: a node's key in the standalone drain bucket (`DRAIN_KV_BUCKET`).

    Keyed by cluster and node, so clusters sharing one NATS account never share a drain record.
    """
    return f"{_check('cluster', cluster)}.{node_token(node)}"


def parse_drain_kv_key(key: str) -> tuple[str, str]:
    """Inverse of `drain_kv_key`: (cluster, node). Raises ValueError for other keys."""
    cluster, sep, token = key.partition(".")
    if not sep:
        raise ValueError(f"not a drain key: {key!r} (expected <cluster>.<node token>)")
    return _check("cluster", cluster), token_node(token)


def perf_subject(cluster: str, node: str) -> str:
    """`fleet.<cluster>.perf.<node token>`: a node's performance samples (`telemetry.PerfSample`)."""
    return f"fleet.{_check('cluster', cluster)}.perf.{node_token(node)}"


def cluster_perf_subject(cluster: str) -> str:
    """`fleet.<cluster>.perf.*`: every node's samples of one cluster (the analyzer's filter)."""
    return f"fleet.{_check('cluster', cluster)}.perf.*"


def all_perf_subject() -> str:
    return "fleet.*.perf.*"


def job_subject(cluster: str, node: str, job: str) -> str:
    """`fleet.<cluster>.job.<node token>.<job>`: step timings of `job` reported by `node` for its own
    ranks (`fleetmend.jobs`). The sender is in the subject, so a node's credentials
    (`node_job_subject`) let it speak for itself only. Raises ValueError for an invalid name."""
    return f"fleet.{_check('cluster', cluster)}.job.{node_token(node)}.{_check('job', job)}"


def node_job_subject(cluster: str, node: str) -> str:
    """`fleet.<cluster>.job.<node token>.*`: every job subject `node` may publish on (its credentials)."""
    return f"fleet.{_check('cluster', cluster)}.job.{node_token(node)}.*"


def cluster_job_subject(cluster: str) -> str:
    return f"fleet.{_check('cluster', cluster)}.job.*.*"


def all_jobs_subject() -> str:
    return "fleet.*.job.*.*"


def parse_job_subject(subject: str) -> tuple[str, str, str]:
    """Inverse of `job_subject`: (cluster, node name, job). Raises ValueError for other subjects
    (the old `fleet.<cluster>.job.<job>` that named no sender included)."""
    parts = subject.split(".")
    if len(parts) != 5 or parts[0] != "fleet" or parts[2] != "job":
        raise ValueError(f"not a job subject: {subject!r} (expected fleet.<cluster>.job.<node token>.<job>)")
    return _check("cluster", parts[1]), token_node(parts[3]), _check("job", parts[4])


def sched_jobs_subject(cluster: str) -> str:
    """`fleet.<cluster>.sched.jobs`: the scheduler's running jobs and their nodes, published by a worker
    (`fleetmend.worker.analyzer_link`, core NATS, every minute) for the fail-slow analyzer. Only the
    worker's credentials may publish it, so no node can make up a job's membership."""
    return f"fleet.{_check('cluster', cluster)}.sched.jobs"


def all_sched_jobs_subject() -> str:
    return "fleet.*.sched.jobs"


def analyzer_status_key(cluster: str) -> str:
    """`status.<cluster>` in `ANALYZER_KV_BUCKET`: what the active analyzer judged last (its domain
    findings among it, which a worker relays to FleetGuard)."""
    return f"status.{_check('cluster', cluster)}"


def parse_perf_subject(subject: str) -> tuple[str, str]:
    """Inverse of `perf_subject`: (cluster, node name). Raises ValueError for other subjects."""
    return _parse_node_subject(subject, "perf")


def sweep_workflow_id(cluster: str, sweep_id: str) -> str:
    """`sweep/<cluster>/<id>`: one on-demand benchmark sweep."""
    return f"sweep/{_check('cluster', cluster)}/{_check('sweep', sweep_id)}"


def all_faults_subject() -> str:
    return "fleet.*.fault.*"


def all_heartbeats_subject() -> str:
    return "fleet.*.hb.*"


def max_deliveries_advisory(stream: str, consumer: str) -> str:
    """JetStream's advisory when a message of `stream` reached `consumer`'s max deliveries."""
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{consumer}"


def parse_fault_subject(subject: str) -> tuple[str, str]:
    """Inverse of `fault_subject`. Returns (cluster, node name), the node decoded by `token_node`.

    Raises:
        ValueError: not a fault subject, or its node token is not canonical.
    """
    return _parse_node_subject(subject, "fault")


def parse_heartbeat_subject(subject: str) -> tuple[str, str]:
    """Inverse of `heartbeat_subject`: (cluster, node name). Raises ValueError for other subjects."""
    return _parse_node_subject(subject, "hb")


def _parse_node_subject(subject: str, kind: str) -> tuple[str, str]:
    parts = subject.split(".")
    if len(parts) != 4 or parts[0] != "fleet" or parts[2] != kind:
        raise ValueError(f"not a {kind} subject: {subject!r} (expected fleet.<cluster>.{kind}.<node token>)")
    return _check("cluster", parts[1]), token_node(parts[3])


def workflow_id(cluster: str, node: str) -> str:
    """`remediate/<cluster>/<node>`: the one `NodeRemediation` workflow id of a node.

    The node name appears as it is (Temporal ids take any string; operators read it in the UI).
    """
    return f"remediate/{_check('cluster', cluster)}/{check_node_name(node)}"


def cluster_task_queue(task_queue: str, cluster: str) -> str:
    """`<task_queue>.<cluster>`: the Temporal task queue of `cluster`'s workflows, which only a worker of that
    cluster polls (`fleetmend.worker.build_worker`), so an incident's drain reaches its own cluster's scheduler
    adapter. `task_queue` is the deployment's `Settings.task_queue` for incidents and sweeps (`fleetmend` →
    `fleetmend.east`), or its guard queue for FleetGuard (`fleetmend-guard` → `fleetmend-guard.east`,
    `messages.guard_task_queue`). A cluster name holds no `.`, so two clusters never share a queue.

    Raises:
        ValueError: an invalid cluster name, or an empty `task_queue`.
    """
    if not task_queue:
        raise ValueError("empty task queue")
    return f"{task_queue}.{_check('cluster', cluster)}"


PRESENCE_KEY_PREFIX = "alive"
"""Presence keys in the lease bucket (`LEASE_KV_BUCKET`): `alive.<role>.<cluster>.<holder token>`."""


def presence_kv_key(role: str, cluster: str, holder: str) -> str:
    """`alive.<role>.<cluster>.<holder token>`: one running process's announcement that it serves `cluster`
    (`fleetmend.infra.lease.Presence`; `role` is `worker` or `router`, `holder` is `<host>:<pid>`, encoded as
    `node_token` encodes a node name). Raises ValueError for an invalid name."""
    return f"{PRESENCE_KEY_PREFIX}.{_check('role', role)}.{_check('cluster', cluster)}.{node_token(holder)}"


def parse_presence_kv_key(key: str) -> tuple[str, str, str]:
    """Inverse of `presence_kv_key`: (role, cluster, holder). Raises ValueError for other keys."""
    parts = key.split(".")
    if len(parts) != 4 or parts[0] != PRESENCE_KEY_PREFIX:
        raise ValueError(f"not a presence key: {key!r} (expected alive.<role>.<cluster>.<holder token>)")
    return _check("role", parts[1]), _check("cluster", parts[2]), token_node(parts[3])


def fleetguard_workflow_id(cluster: str) -> str:
    """`fleetguard/<cluster>`: the one `FleetGuard` workflow (drain budget, breaker) of a cluster."""
    return f"fleetguard/{_check('cluster', cluster)}"


def parse_workflow_id(wid: str) -> tuple[str, str]:
    """Inverse of `workflow_id`: (cluster, node). Raises ValueError for other ids."""
    parts = wid.split("/")
    if len(parts) != 3 or parts[0] != "remediate":
        raise ValueError(f"not a remediation workflow id: {wid!r}")
    return _check("cluster", parts[1]), check_node_name(parts[2])


def msg_id(event_id: str) -> str:
    """JetStream `Nats-Msg-Id` for an event: the event id itself (dedupe across re-sends)."""
    return event_id


def fingerprint_kv_key(cluster: str, node: str) -> str:
    """`<cluster>.<node token>`: a node's key in `FINGERPRINT_KV_BUCKET`. Raises ValueError for bad names."""
    return f"{_check('cluster', cluster)}.{node_token(node)}"


def parse_fingerprint_kv_key(key: str) -> tuple[str, str]:
    """Inverse of `fingerprint_kv_key`: (cluster, node). Raises ValueError for other keys."""
    return parse_drain_kv_key(key)


def fingerprint_subject(cluster: str, node: str) -> str:
    """`fleet.<cluster>.fingerprint.<node token>`: a node's `FingerprintChange` records."""
    return f"fleet.{_check('cluster', cluster)}.fingerprint.{node_token(node)}"


def all_fingerprints_subject() -> str:
    return "fleet.*.fingerprint.*"


def reconfigure_subject(cluster: str, node: str) -> str:
    """`fleet.<cluster>.reconfigure.<node token>`: request/reply live fixes answered by the node's agent."""
    return f"fleet.{_check('cluster', cluster)}.reconfigure.{node_token(node)}"


def drift_allow_kv_key(cluster: str, fact: str) -> str:
    """`<cluster>.<fact token>`: an allowed set in `DRIFT_ALLOW_KV_BUCKET` (the fact key token-encoded, as a node)."""
    return f"{_check('cluster', cluster)}.{node_token(fact)}"


# ---------------------------------------------------------------- the incident ledger (issue 26)

def ledger_open_key(cluster: str, node: str) -> str:
    """`open.<cluster>.<node token>`: the node's open incident record in `LEDGER_KV_BUCKET` (one at a time)."""
    return f"open.{_check('cluster', cluster)}.{node_token(node)}"


def ledger_closed_key(cluster: str, node: str, drained_ms: int) -> str:
    """`inc.<cluster>.<node token>.<drained at, epoch ms>`: a closed incident record in `LEDGER_KV_BUCKET`."""
    return f"inc.{_check('cluster', cluster)}.{node_token(node)}.{int(drained_ms)}"


def ledger_pack_key(cluster: str, day: str, part: int) -> str:
    """`pack.<cluster>.<YYYYMMDD>.<part>`: closed records of `cluster` that closed on that UTC day, many per value
    (`fleetmend.ledger.encode_pack`), written by the roll-up (`fleetmend.infra.ledger.LedgerStore.roll_up`)."""
    if len(day) != 8 or not day.isdigit():
        raise ValueError(f"pack day {day!r}: expected YYYYMMDD")
    return f"pack.{_check('cluster', cluster)}.{day}.{int(part)}"


def ledger_pack_prefix(cluster: str | None) -> str:
    """The key prefix of `cluster`'s packs (`pack.<cluster>.`; every cluster: `pack.`)."""
    return f"pack.{_check('cluster', cluster)}." if cluster else "pack."


def ledger_route_key(cluster: str, node: str) -> str:
    """`route.<cluster>.<node token>`: the router's recent drain-worthy routings of the node (when each fault
    reached an incident), read by the drain that opens the node's record."""
    return f"route.{_check('cluster', cluster)}.{node_token(node)}"


def ledger_part_key(serial: str) -> str:
    """`part.<sha1 of the serial, 24 hex>`: the failures of one part (a GPU's UUID or serial), fleet-wide."""
    import hashlib

    return "part." + hashlib.sha1(serial.encode()).hexdigest()[:24]


def ledger_cluster_prefixes(cluster: str | None) -> tuple[str, str]:
    """The key prefixes of closed and open records (`inc.<cluster>.`, `open.<cluster>.`; every cluster: `inc.`,
    `open.`)."""
    c = f"{_check('cluster', cluster)}." if cluster else ""
    return f"inc.{c}", f"open.{c}"
