#!/usr/bin/env bash
# A local 4-node Slurm cluster (node1..node4, all on this host) for trying `--scheduler slurm`.
# Same recipe as tests/fixtures_slurm.py: free ports picked at
# start, munged started if it doesn't answer, daemons stopped by PID. Needs root and
# `.ci/install-slurm.sh` (slurmctld slurmd slurm-client munge).
#
#   scripts/slurm-dev.sh start    # prints: export SLURM_CONF=...
#   scripts/slurm-dev.sh status   # sinfo -N
#   scripts/slurm-dev.sh stop
#
# Directory: $SLURM_DEV_DIR (default ${XDG_STATE_HOME:-~/.local/state}/fleetmend/slurm-dev).
set -euo pipefail

DIR="${SLURM_DEV_DIR:-${XDG_STATE_HOME:-$HOME/.local/state}/fleetmend/slurm-dev}"
CONF="$DIR/slurm.conf"
NODES=(node1 node2 node3 node4)
export SLURM_CONF="$CONF"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
  munge_ok && return 0
  if [ ! -f /etc/munge/munge.key ]; then
    if command -v mungekey >/dev/null; then mungekey --create --keyfile /etc/munge/munge.key
    else /usr/sbin/create-munge-key -f; fi
    chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
  fi
  mkdir -p /run/munge && chown munge:munge /run/munge && chmod 755 /run/munge
  runuser -u munge -- munged
  for _ in $(seq 1 100); do munge_ok && return 0; sleep 0.1; done
  echo "munged did not answer; see /var/log/munge/munged.log" >&2; exit 1
}

write_conf() {
  mkdir -p "$DIR"/{state,log} && for n in "${NODES[@]}"; do mkdir -p "$DIR/spool/$n"; done
  local ctld; ctld=$(free_port)
  {
    echo "ClusterName=fmdev"
    echo "SlurmctldHost=localhost(127.0.0.1)"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "SlurmctldPort=$ctld"
    echo "SlurmdPort=$(free_port)"
    echo "AuthType=auth/munge"
    echo "CredType=cred/munge"
    echo "StateSaveLocation=$DIR/state"
    echo "SlurmdSpoolDir=$DIR/spool/%n"
    echo "SlurmctldPidFile=$DIR/slurmctld.pid"
    echo "SlurmdPidFile=$DIR/slurmd-%n.pid"
    echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
    echo "SlurmdLogFile=$DIR/log/slurmd-%n.log"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "JobCompType=jobcomp/none"
    echo "SchedulerType=sched/backfill"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    echo "SlurmdParameters=config_overrides"
    echo "ReturnToService=2"
    echo "SlurmdTimeout=30"
    echo "MpiDefault=none"
    echo "SwitchType=switch/none"
    for n in "${NODES[@]}"; do
      echo "NodeName=$n NodeHostname=localhost NodeAddr=127.0.0.1 Port=$(free_port) CPUs=1 RealMemory=1000 State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP"
  } > "$CONF"
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

cmd_start() {
  if alive "$DIR/slurmctld.pid"; then
    echo "already running (slurmctld pid $(cat "$DIR/slurmctld.pid"))"
  else
    start_munge
    write_conf   # fresh free ports every start; drain state survives in $DIR/state
    local first=""; [ -f "$DIR/state/node_state" ] || first="-i"
    slurmctld $first
    for n in "${NODES[@]}"; do slurmd -N "$n"; done
    local ok=""
    for _ in $(seq 1 300); do
      if [ "$(sinfo -h -N -o '%N %T' 2>/dev/null | grep -cvE '\*|down|unknown')" = "${#NODES[@]}" ]; then ok=1; break; fi
      sleep 0.1
    done
    [ -n "$ok" ] || { echo "nodes not up after 30 s; logs in $DIR/log" >&2; sinfo -N >&2 || true; exit 1; }
    sinfo -N
  fi
  echo
  echo "export SLURM_CONF=$CONF"
  echo "# then run fleetmend with FLEETMEND_SCHEDULER=slurm FLEETMEND_SLURM__SLURM_CONF=$CONF"
}

cmd_stop() {
  # Collect PIDs first, SIGTERM all, then wait for each to exit: a slurmd that is still exiting
  # would remove the pid file a restarted one just wrote.
  local pids=() f
  for f in "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid"; do
    alive "$f" && pids+=("$(cat "$f")")
  done
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do
    for _ in $(seq 1 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$p" 2>/dev/null && kill -9 "$p" 2>/dev/null || true
  done
  echo "stopped (munged left running; state kept in $DIR)"
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) sinfo -N -o '%N %T %E' ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
