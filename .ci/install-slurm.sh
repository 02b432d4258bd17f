#!/usr/bin/env bash
# Install Slurm (slurmctld, slurmd, client) and munge from Debian for the real-Slurm tests.
# Idempotent: does nothing when the binaries are already there. Needs root (CI runs as root).
set -euo pipefail

need=(slurmctld slurmd scontrol sinfo sbatch munged munge unmunge)
missing=()
for b in "${need[@]}"; do
  command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || missing+=("$b")
done
if [ "${#missing[@]}" -eq 0 ]; then
  echo "install-slurm: already installed ($(slurmd -V 2>/dev/null || echo slurmd))"
  exit 0
fi
echo "install-slurm: missing ${missing[*]}; installing from apt"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
  slurmctld slurmd slurm-client munge
# The munge postinst creates /etc/munge/munge.key; no daemon is started (no systemd here).
slurmd -V
