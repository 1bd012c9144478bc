#!/usr/bin/env bash
# Make sure Debian's slurm-wlm (slurmctld, slurmd, munge, the clients) is installed, so that
# tests/nodes/test_nodes_slurm.py runs the example sbatch script under a real Slurm instead of
# skipping. Called by `./run.sh test` before pytest; never fails the caller: where it cannot
# install (not root, no apt-get, no network) it says why and exits 0, and the test skips
# with its own reason. About 20 s on a fresh Debian 12 machine (apt-get update included).
# STEADYTRAIN_NO_SLURM_INSTALL=1 skips it.
set -uo pipefail

say() { echo "[ensure-slurm] $*" >&2; }

if command -v slurmctld >/dev/null 2>&1 || [ -x /usr/sbin/slurmctld ]; then
    exit 0
fi
if [ -n "${STEADYTRAIN_NO_SLURM_INSTALL:-}" ]; then
    say "slurm-wlm missing; not installing (STEADYTRAIN_NO_SLURM_INSTALL is set):" \
        "the Slurm test will skip"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    say "slurm-wlm missing and not root: run 'sudo apt-get install slurm-wlm'" \
        "for the Slurm test (it will skip)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    say "slurm-wlm missing and no apt-get here: install slurm-wlm (22.05+) by hand" \
        "for the Slurm test (it will skip)"
    exit 0
fi
say "installing slurm-wlm for the Slurm test (apt-get; about 20 s)..."
start=$(date +%s)
export DEBIAN_FRONTEND=noninteractive
# The package may start its own services with the machine's /etc/slurm (none: they stop);
# the test starts its own daemons with their own config, sockets and ports.
if apt-get update -qq >/dev/null 2>&1 \
    && apt-get install -y -qq slurm-wlm munge >/dev/null 2>&1; then
    say "slurm-wlm installed in $(($(date +%s) - start)) s"
else
    say "apt-get install slurm-wlm failed: the Slurm test will skip;" \
        "run 'apt-get install slurm-wlm' by hand to see why"
fi
exit 0
