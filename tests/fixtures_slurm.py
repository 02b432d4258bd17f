"""A real 4-node Slurm cluster on this one host, for the scheduler adapter tests.

`slurm_cluster` (session scope) writes a slurm.conf in a temp dir (4 nodes `node[1-4]`, all
`NodeHostname=localhost`, every port picked free at runtime), makes sure munged answers (one it starts
itself is stopped with the cluster, so a test run leaves no daemon behind), starts
`slurmctld -D -i` and four `slurmd -D -N nodeN` as child processes (foreground, so teardown is by
PID), and waits until every node is `idle`.

Missing binaries: `pytest.fail` in CI (`CI=true`: these tests must run there), else `pytest.skip`
with the apt-get line. `scripts/slurm-dev.sh` starts the same cluster for operators.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fleetmend.dev import servers

NODES = ["node1", "node2", "node3", "node4"]
_BINARIES = ["slurmctld", "slurmd", "scontrol", "sinfo", "sbatch", "munged", "munge", "unmunge"]
_INSTALL = ("apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y "
            "--no-install-recommends slurmctld slurmd slurm-client munge   (or .ci/install-slurm.sh)")
_READY_TIMEOUT_S = 30.0
"""All 4 nodes are idle 0.2 s after start here; 30 s allows a slow CI runner."""


_PR_SET_PDEATHSIG = 1


def _session_dying_with_parent() -> None:
    """preexec_fn: own session (no terminal signals) and SIGTERM when pytest dies, even by SIGKILL or a
    CI timeout, so a killed test run never leaves slurmctld/slurmd behind holding ports."""
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _unavailable(why: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"Slurm tests must run in CI but {why}; install with: {_INSTALL}")
    pytest.skip(f"{why}; install with: {_INSTALL}")


def write_slurm_conf(root: Path, ports: dict[str, int], nodes: list[str] = NODES) -> Path:
    """Write `root/slurm.conf` for `nodes` on localhost. Returns its path.

    Args:
        root: scratch directory (state, spool, logs and pid files go under it).
        ports: `slurmctld`, `slurmd` and one per node name.
    """
    for sub in ("state", "log", *(f"spool/{n}" for n in nodes)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    lines = [
        f"ClusterName=fm{ports['slurmctld']}",
        "SlurmctldHost=localhost(127.0.0.1)",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"SlurmctldPort={ports['slurmctld']}",
        f"SlurmdPort={ports['slurmd']}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        # Small fake nodes so 4 fit on 2 real cores without the "low core count" auto-drain.
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        "SlurmdTimeout=30",
        "MpiDefault=none",
        "SwitchType=switch/none",
    ]
    for n in nodes:
        lines.append(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={ports[n]} "
                     "CPUs=1 RealMemory=1000 State=UNKNOWN")
    lines.append(f"PartitionName=debug Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP")
    conf = root / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    return conf


def munge_works() -> bool:
    """True when a credential round-trips through the running munged."""
    try:
        cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=5)
        if cred.returncode != 0:
            return False
        out = subprocess.run(["unmunge"], input=cred.stdout, capture_output=True, timeout=5)
        return out.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def require_slurm() -> None:
    """Skip the calling test where Slurm cannot run here (binaries missing, not root); fail it in CI."""
    missing = [b for b in _BINARIES if shutil.which(b) is None]
    if missing:
        _unavailable(f"Slurm/munge binaries missing: {', '.join(missing)}")
    if os.geteuid() != 0:
        _unavailable("the test cluster needs root (munged, SlurmdUser=root)")


def ensure_munged() -> subprocess.Popen | None:
    """Start munged (as the munge user, in the foreground, as a child of this process) unless one
    already answers. Needs root.

    Returns:
        The munged process this call started (stop it with the cluster), or None when one already
        answered (someone else's: left alone).
    Raises:
        RuntimeError: munged did not answer within 10 s.
    """
    if munge_works():
        return None
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        if shutil.which("mungekey"):
            subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True)
        else:
            subprocess.run(["/usr/sbin/create-munge-key", "-f"], check=True)
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
    run = Path("/run/munge")
    run.mkdir(parents=True, exist_ok=True)
    shutil.chown(run, "munge", "munge")
    run.chmod(0o755)
    # A concurrent session may have started munged a moment ago (then this one exits at once on the taken
    # socket); what matters is that a credential round-trips below.
    proc = subprocess.Popen(["runuser", "-u", "munge", "--", "munged", "--foreground"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_session_dying_with_parent)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if munge_works():
            return proc if proc.poll() is None else None
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("munged started but `munge -n | unmunge` still fails after 10 s; see /var/log/munge/")


@dataclass
class SlurmCluster:
    """A running test cluster. `env` carries SLURM_CONF for any subprocess that talks to it."""

    root: Path
    conf: Path
    nodes: list[str]
    env: dict[str, str]
    procs: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster; returns the completed process."""
        out = subprocess.run(list(argv), capture_output=True, text=True, env=self.env, timeout=30)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} -> rc {out.returncode}: {out.stderr.strip()}")
        return out

    def sinfo_state(self, node: str) -> str:
        """sinfo's long state word for `node`: idle, idle*, draining, drained, down*, …"""
        return self.run("sinfo", "-h", "-N", "-n", node, "-o", "%T").stdout.strip()

    def state(self, node: str) -> str:
        """scontrol's raw State for `node`, e.g. IDLE, IDLE+DRAIN, ALLOCATED+DRAIN, DOWN*."""
        return self._show(node).get("State", "")

    def reason(self, node: str) -> str:
        """The node's Reason as scontrol prints it (with the trailing `[user@time]`), or ''."""
        return self._show(node).get("Reason", "")

    def _show(self, node: str) -> dict[str, str]:
        from activities.slurm import parse_scontrol_node

        return parse_scontrol_node(self.run("scontrol", "-o", "show", "node", node).stdout)

    def resume_all(self) -> None:
        """Return every node to service (test isolation): RESUME whatever is drained or down."""
        for n in self.nodes:
            st = self.state(n)
            if "DRAIN" in st or "DOWN" in st or "FAIL" in st:
                self.run("scontrol", "update", f"NodeName={n}", "State=RESUME", check=False)

    def wait_idle(self, nodes: list[str] | None = None, timeout_s: float = _READY_TIMEOUT_S) -> None:
        """Block until every node in `nodes` is plain `idle` (no `*`, no drain)."""
        want = nodes or self.nodes
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
            states = dict(line.split(None, 1) for line in out.splitlines() if line.strip())
            if all(states.get(n) == "idle" for n in want):
                return
            time.sleep(0.1)
        raise AssertionError(f"nodes not idle after {timeout_s}s: {states}; logs under {self.root / 'log'}")

    def log_tail(self, name: str = "slurmctld", n: int = 30) -> str:
        p = self.root / "log" / f"{name}.log"
        return "\n".join(p.read_text(errors="replace").splitlines()[-n:]) if p.exists() else ""

    def stop(self) -> None:
        """SIGTERM each daemon by PID (slurmds first), SIGKILL after 10 s."""
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)


def start_cluster(root: Path, nodes: list[str] = NODES) -> SlurmCluster:
    """Start munged (if needed), slurmctld and one slurmd per node under `root`; wait until idle.

    Raises:
        RuntimeError: a daemon exited during start (with the tail of its log).
    """
    ports = {"slurmctld": servers.free_port(), "slurmd": servers.free_port()}
    ports.update({n: servers.free_port() for n in nodes})
    conf = write_slurm_conf(root, ports, nodes)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    munged = ensure_munged()
    # stop() ends the daemons in reverse order: munged, when this call started it, goes last
    cluster = SlurmCluster(root=root, conf=conf, nodes=list(nodes), env=env, procs=[munged] if munged else [])

    def spawn(name: str, argv: list[str]) -> None:
        log = open(root / "log" / f"{name}.stdout", "ab")
        cluster.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                              preexec_fn=_session_dying_with_parent))
        log.close()

    try:
        spawn("slurmctld", ["slurmctld", "-D", "-i"])
        for n in nodes:
            spawn(f"slurmd-{n}", ["slurmd", "-D", "-N", n])
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while True:
            for p in cluster.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args} exited with {p.returncode} during start:\n"
                                       f"{cluster.log_tail()}")
            try:
                cluster.wait_idle(timeout_s=0.5)
                return cluster
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
    except BaseException:
        cluster.stop()
        raise


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory):
    """A real 4-node Slurm cluster on localhost (see module docstring). Yields `SlurmCluster`."""
    require_slurm()
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster):
    """The session cluster with every node back in service before and after the test."""
    slurm_cluster.resume_all()
    slurm_cluster.wait_idle()
    yield slurm_cluster
    slurm_cluster.resume_all()
