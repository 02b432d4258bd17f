"""NATS credentials and authorization: one nkey per node, router, worker and operator, and the
nats-server `accounts` block that gives each exactly the subjects its role needs.

Permissions (subjects from `fleetmend.subjects`, so code and config cannot drift):

    node <n> of cluster <c>
      publish    fleet.<c>.fault.<n>, fleet.<c>.hb.<n>          its own faults and heartbeats,
                 fleet.<c>.perf.<n>, fleet.<c>.job.<n>.*          its telemetry, its own ranks' step timings
                 allow_responses (1 reply per request received) answers its own diag requests only
      subscribe  fleet.<c>.diag.<n>                               its own diagnostics requests
                 _INBOX.<c>.<n>.>                                 replies to it (JetStream publish acks):
                                                                  the agent connects with inbox prefix
                                                                  `_INBOX.<c>.<n>` (`nats_inbox_prefix`),
                                                                  so it cannot read other clients' replies
    router     publish   the JetStream API calls it makes on its two streams and its durable consumer
                         (stream info/create, consumer info/create, fetch, message get), acks
                         ($JS.ACK.<fault stream>.<durable>.>), fleet.deadletter, fleet.*.fault.*
                         (`agent_silent` events for nodes whose heartbeats stopped), the lease
                         bucket (`$KV.<lease bucket>.>` and its API calls: the elected publisher of
                         the consumer-lag gauge), the permit pool bucket and the drain bucket (a fault
                         that must drain now: a pool slot, then the standalone scheduler's drain)
               subscribe fleet.*.hb.* (heartbeats), the max-deliveries advisory of its consumer,
                         _INBOX_router.> (its own inbox prefix)
    worker     publish   fleet.*.diag.* (diagnostics, recovery and sweep benchmark requests), fleet.*.fault.*
                         (fail_slow of `fleetmend sweep --act`), fleet.*.sched.jobs (the scheduler's
                         running jobs, for the analyzer), reading the analyzer bucket's entries (its
                         status: the domain findings it relays to FleetGuard), $KV.<drain bucket>.>
                         and the JetStream API calls of that bucket (stream info/create, direct and
                         message get, consumer create/info/delete for key listings, flow control);
                         the same for the ticket ledger, lease, notifications-sent and permit pool buckets
                         and the incident ledger, whose stream it may also purge (by subject and
                         sequence: the ledger's roll-up removes each packed record's own message)
               subscribe _INBOX_worker.> (its own inbox prefix)
    analyzer   publish   the JetStream API calls of its ordered consumers on the perf and job streams
                         (consumer create/delete, flow control) and of its KV bucket (lease, state),
                         $KV.<analyzer bucket>.>, fleet.*.fault.* (fail_slow), fleet.deadletter
               subscribe _INBOX_analyzer.> (its own inbox prefix), fleet.*.sched.jobs (the worker's
                         list of the scheduler's running jobs: no node may publish it)
    admin      everything (CLI `status`/`deadletters`, `dev up`, stream setup)

No role gets `$JS.API.>`: a router credential cannot delete a stream or read the KV bucket, a worker
credential cannot read faults. Router and worker must connect with their inbox prefix
(`nats_inbox_prefix`, written into `<role>.toml` by `generate`), like the agents.

A JetStream publish needs nothing but publish on the subject and subscribe on the reply inbox (the
ack comes from the server); agents with node credentials do not touch the streams (`agent.manage_stream
= false` in their settings), the router (or an operator) owns them. One account (`FLEET`, JetStream enabled) holds every user:
JetStream streams are per account, and separate accounts would need stream exports/imports for the
router and worker without narrowing anything the per-user permissions do not already narrow.

Seeds are written 0600, one file each, and are reused when `generate` runs again (adding nodes does
not rotate the existing keys). Imports only stdlib and `nkeys`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys

from fleetmend import subjects
from fleetmend.errors import ConfigError

ACCOUNT = "FLEET"
ROLES = ("router", "worker", "analyzer", "admin")


def node_inbox_prefix(cluster: str, node: str) -> str:
    """`_INBOX.<cluster>.<node token>`: the inbox prefix a node's agent uses (its replies land under it)."""
    return subjects.inbox_prefix(cluster, node)


def role_inbox_prefix(role: str) -> str:
    """`_INBOX_<role>`: the inbox prefix of the router or worker (outside the nodes' `_INBOX.`)."""
    return f"_INBOX_{role}"


def _api(*calls: str) -> list[str]:
    return [f"$JS.API.{c}" for c in calls]


def node_permissions(cluster: str, node: str) -> dict:
    """nats-server `permissions` of one node's agent (see module docstring)."""
    return {
        "publish": {"allow": [subjects.fault_subject(cluster, node), subjects.heartbeat_subject(cluster, node),
                              subjects.perf_subject(cluster, node), subjects.node_job_subject(cluster, node),
                              # its fingerprint: the change record, its own key of the latest-fingerprint
                              # bucket, and reading the two stores' info (the analyzer creates them)
                              subjects.fingerprint_subject(cluster, node),
                              f"$KV.{subjects.FINGERPRINT_KV_BUCKET}.{subjects.fingerprint_kv_key(cluster, node)}",
                              *_api(f"STREAM.INFO.{subjects.FINGERPRINT_STREAM}",
                                    f"STREAM.INFO.KV_{subjects.FINGERPRINT_KV_BUCKET}",
                                    f"DIRECT.GET.KV_{subjects.FINGERPRINT_KV_BUCKET}.$KV.{subjects.FINGERPRINT_KV_BUCKET}."
                                    f"{subjects.fingerprint_kv_key(cluster, node)}")]},
        "subscribe": {"allow": [subjects.diag_subject(cluster, node), subjects.reconfigure_subject(cluster, node),
                                node_inbox_prefix(cluster, node) + ".>"]},
        "allow_responses": {"max": 1, "expires": "10m"},
    }


def _kv_bucket(bucket: str) -> list[str]:
    """Publish permissions to use one JetStream KV bucket: its keys, and the API calls on its stream
    (info/create, direct and message get, consumers for key listings, flow control)."""
    kv = f"KV_{bucket}"
    return [*_api(f"STREAM.INFO.{kv}", f"STREAM.CREATE.{kv}", f"STREAM.MSG.GET.{kv}", f"DIRECT.GET.{kv}",
                  f"DIRECT.GET.{kv}.>", f"CONSUMER.CREATE.{kv}", f"CONSUMER.CREATE.{kv}.>", f"CONSUMER.INFO.{kv}.>",
                  f"CONSUMER.DELETE.{kv}.>"), f"$KV.{bucket}.>", f"$JS.FC.{kv}.>"]


def role_permissions(role: str) -> dict | None:
    """Permissions of `router`, `worker` or `admin` (None: unrestricted).

    Raises:
        ConfigError: unknown role, listing the valid ones.
    """
    if role == "router":
        fs, dl, dur = subjects.FAULT_STREAM, subjects.DEADLETTER_STREAM, subjects.ROUTER_DURABLE
        api = _api(f"STREAM.INFO.{fs}", f"STREAM.CREATE.{fs}", f"STREAM.INFO.{dl}", f"STREAM.CREATE.{dl}",
                   f"CONSUMER.INFO.{fs}.{dur}", f"CONSUMER.CREATE.{fs}.{dur}", f"CONSUMER.CREATE.{fs}.{dur}.>",
                   f"CONSUMER.DURABLE.CREATE.{fs}.{dur}", f"CONSUMER.MSG.NEXT.{fs}.{dur}", f"STREAM.MSG.GET.{fs}")
        return {"publish": {"allow": [*api, f"$JS.ACK.{fs}.{dur}.>", subjects.DEADLETTER_SUBJECT,
                                      subjects.all_faults_subject(), *_kv_bucket(subjects.LEASE_KV_BUCKET),
                                      *_kv_bucket(subjects.PERMIT_KV_BUCKET), *_kv_bucket(subjects.DRAIN_KV_BUCKET),
                                      *_kv_bucket(subjects.LEDGER_KV_BUCKET)]},  # the incident ledger's notes
                "subscribe": {"allow": [subjects.all_heartbeats_subject(), subjects.max_deliveries_advisory(fs, dur),
                                        role_inbox_prefix("router") + ".>"]}}
    if role == "worker":
        buckets = (subjects.DRAIN_KV_BUCKET, subjects.TICKET_KV_BUCKET, subjects.LEASE_KV_BUCKET,
                   subjects.NOTIFY_KV_BUCKET, subjects.PERMIT_KV_BUCKET, subjects.LEDGER_KV_BUCKET)
        fp = f"KV_{subjects.FINGERPRINT_KV_BUCKET}"  # the ledger reads fingerprints (versions, serials): reads only
        akv = f"KV_{subjects.ANALYZER_KV_BUCKET}"  # the analyzer's status, read (its domain findings)
        return {"publish": {"allow": [p for b in buckets for p in _kv_bucket(b)] + _api(
                    f"STREAM.INFO.{fp}", f"DIRECT.GET.{fp}", f"DIRECT.GET.{fp}.>", f"STREAM.MSG.GET.{fp}",
                    f"CONSUMER.CREATE.{fp}", f"CONSUMER.CREATE.{fp}.>", f"CONSUMER.INFO.{fp}.>",
                    f"CONSUMER.DELETE.{fp}.>",
                    f"STREAM.INFO.{akv}", f"STREAM.MSG.GET.{akv}", f"DIRECT.GET.{akv}", f"DIRECT.GET.{akv}.>",
                    # the ledger's roll-up purges each packed record's own message (fleetmend.infra.ledger.roll_up)
                    f"STREAM.PURGE.KV_{subjects.LEDGER_KV_BUCKET}") + [
                    f"$JS.FC.{fp}.>",
                    "fleet.*.diag.*", "fleet.*.reconfigure.*",  # diagnostics, sweeps, live fixes (reconfigure_node)
                    subjects.all_faults_subject(),  # fail_slow of `fleetmend sweep --act`
                    subjects.all_sched_jobs_subject()]},  # the scheduler's running jobs, for the analyzer
                "subscribe": {"allow": [role_inbox_prefix("worker") + ".>"]}}
    if role == "analyzer":
        ps, js_, kv = subjects.PERF_STREAM, subjects.JOB_STREAM, f"KV_{subjects.ANALYZER_KV_BUCKET}"
        api = _api(f"STREAM.INFO.{ps}", f"STREAM.CREATE.{ps}", f"STREAM.INFO.{js_}", f"STREAM.CREATE.{js_}",
                   f"CONSUMER.CREATE.{ps}", f"CONSUMER.CREATE.{ps}.>", f"CONSUMER.DELETE.{ps}.>",
                   f"CONSUMER.CREATE.{js_}", f"CONSUMER.CREATE.{js_}.>", f"CONSUMER.DELETE.{js_}.>",
                   f"STREAM.INFO.{kv}", f"STREAM.CREATE.{kv}", f"STREAM.MSG.GET.{kv}", f"DIRECT.GET.{kv}",
                   f"DIRECT.GET.{kv}.>")
        fs = subjects.FINGERPRINT_STREAM  # the drift judge creates the fingerprint stores and reads them
        api += _api(f"STREAM.INFO.{fs}", f"STREAM.CREATE.{fs}")
        pool = f"KV_{subjects.PERMIT_KV_BUCKET}"  # the drift judge's repair watch reads (only) who is drained
        api += _api(f"STREAM.INFO.{pool}", f"STREAM.MSG.GET.{pool}", f"DIRECT.GET.{pool}", f"DIRECT.GET.{pool}.>")
        drift = [*_kv_bucket(subjects.FINGERPRINT_KV_BUCKET), *_kv_bucket(subjects.DRIFT_ALLOW_KV_BUCKET)]
        return {"publish": {"allow": [*api, *drift, f"$KV.{subjects.ANALYZER_KV_BUCKET}.>", f"$JS.FC.{ps}.>",
                                      f"$JS.FC.{js_}.>", subjects.all_faults_subject(), subjects.DEADLETTER_SUBJECT]},
                "subscribe": {"allow": [role_inbox_prefix("analyzer") + ".>", subjects.all_sched_jobs_subject()]}}
    if role == "admin":
        return None
    raise ConfigError(f"unknown role {role!r}; expected {', '.join(ROLES)} (nodes get node credentials)")


def new_seed() -> bytes:
    """A fresh nkey user seed (`SU…`)."""
    return nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)


def public_key(seed: bytes) -> str:
    """The public user key (`U…`) of `seed`. Raises ConfigError for an invalid seed."""
    try:
        return nkeys.from_seed(bytearray(seed.strip())).public_key.decode()
    except Exception as err:
        raise ConfigError(f"invalid nkey seed: {err}") from err


def _load_or_create_seed(path: Path) -> bytes:
    if path.exists():
        seed = path.read_bytes().strip()
        public_key(seed)
        return seed
    path.parent.mkdir(parents=True, exist_ok=True)
    seed = new_seed()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(seed + b"\n")
    return seed


@dataclass
class Credential:
    name: str
    """`node:<cluster>/<node>` or the role name."""
    public_key: str
    seed_file: Path
    permissions: dict | None
    settings_file: Path | None = None
    """The node's agent settings snippet (TOML) using the seed."""


@dataclass
class CredentialSet:
    directory: Path
    accounts_conf: Path
    credentials: list[Credential]

    def seed_file(self, name: str) -> Path:
        for c in self.credentials:
            if c.name == name:
                return c.seed_file
        raise KeyError(f"no credential {name!r}; have {', '.join(c.name for c in self.credentials)}")


def _conf_value(v: object) -> str:
    """nats-server config values are a JSON superset: JSON encoding is valid config."""
    return json.dumps(v)


def accounts_conf(creds: list[Credential]) -> str:
    """The `accounts { FLEET { jetstream: enabled, users: [...] } }` block for nats-server."""
    lines = ["# generated by `fleetmend creds generate`; include from nats-server.conf", "accounts {",
             f"  {ACCOUNT}: {{", "    jetstream: enabled", "    users: ["]
    for c in creds:
        user: dict[str, Any] = {"nkey": c.public_key}
        if c.permissions is not None:
            user["permissions"] = c.permissions
        lines.append(f"      # {c.name}")
        lines.append(f"      {_conf_value(user)}")
    lines += ["    ]", "  }", "}", ""]
    return "\n".join(lines)


def generate(directory: Path, cluster: str, nodes: list[str], roles: tuple[str, ...] = ROLES) -> CredentialSet:
    """Write (or reuse) nkey seeds and the nats-server accounts block.

    Layout under `directory`:
        nodes/<node>.nk         the node's seed (0600)
        nodes/<node>.toml       agent settings: cluster, node, nats_nkey_seed, nats_inbox_prefix
        <role>.nk               router / worker / admin seeds (0600)
        <role>.toml             settings: nats_nkey_seed and (router, worker) nats_inbox_prefix
        accounts.conf           `include` it from the server's config
    Args:
        directory: output directory (created).
        cluster: cluster name (subject token).
        nodes: node names as the scheduler spells them (dots allowed; `subjects.check_node_name`).
        roles: service roles to generate.
    Returns:
        `CredentialSet`.
    Raises:
        ConfigError: an invalid name, role, or an existing seed file that is not a seed.
    """
    directory = Path(directory)
    creds: list[Credential] = []
    for node in nodes:
        try:
            subjects.fault_subject(cluster, node)
        except ValueError as err:
            raise ConfigError(str(err)) from err
        seed_file = directory / "nodes" / f"{node}.nk"
        seed = _load_or_create_seed(seed_file)
        toml = directory / "nodes" / f"{node}.toml"
        # TOML basic strings take JSON's escapes: json.dumps quotes any node name safely.
        toml.write_text(
            f'# agent settings; use with `fleetmend agent --config <this file>` (or merge)\n'
            f'cluster = {json.dumps(cluster)}\nnode = {json.dumps(node)}\n'
            f'nats_nkey_seed = {json.dumps(str(seed_file.resolve()))}\n'
            f'nats_inbox_prefix = {json.dumps(node_inbox_prefix(cluster, node))}\n'
            '[agent]\nmanage_stream = false  # the router/operator owns the streams\n')
        creds.append(Credential(f"node:{cluster}/{node}", public_key(seed), seed_file,
                                node_permissions(cluster, node), toml))
    for role in roles:
        perms = role_permissions(role)
        seed_file = directory / f"{role}.nk"
        seed = _load_or_create_seed(seed_file)
        toml = directory / f"{role}.toml"
        prefix = f'nats_inbox_prefix = "{role_inbox_prefix(role)}"\n' if perms is not None else ""
        toml.write_text(f"# {role} settings; use with `fleetmend {role} --config {toml.name}` (or merge)\n"
                        f'nats_nkey_seed = "{seed_file.resolve()}"\n{prefix}')
        creds.append(Credential(role, public_key(seed), seed_file, perms, toml))
    conf = directory / "accounts.conf"
    conf.write_text(accounts_conf(creds))
    return CredentialSet(directory, conf, creds)


def server_conf(accounts_file: Path, store_dir: Path | None = None, *, tls_cert: Path | None = None, tls_key: Path | None = None,
                tls_ca: Path | None = None) -> str:
    """A minimal nats-server config (JetStream + the accounts block, optional TLS) for tests and dev.

    Listen address and port come from the command line (`fleetmend.dev.servers.start_nats`), and so do
    `-js -sd` unless `store_dir` is given here (the server refuses both).
    """
    # Inlined, not `include`d: nats-server resolves include paths against the including file's directory.
    out = [f"jetstream {{ store_dir: {_conf_value(str(store_dir))} }}"] if store_dir else []
    out.append(Path(accounts_file).read_text())
    if tls_cert and tls_key:
        tls = {"cert_file": str(tls_cert), "key_file": str(tls_key)}
        if tls_ca:
            tls["ca_file"] = str(tls_ca)
        out.append(f"tls {_conf_value(tls)}")
    return "\n".join(out) + "\n"
