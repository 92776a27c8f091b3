#!/usr/bin/env bash
# The tests marked `slurm` (tests/slurm): each session starts a private 2-node Slurm cluster on this host (munged,
# slurmctld and two slurmd daemons, all under a temporary directory) and stops it at the end. Installs Slurm 22.05
# from Debian's packages where missing; without root (or apt-get) it says so in one line and passes, as the tests
# would skip. Run from the README's test command, with the venv's python first on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(slurmctld slurmd slurm-client munge)
installed() {  # the programs tests/slurm/cluster.py runs, wherever they came from (the daemons are in /usr/sbin)
    local name
    for name in munged mungekey slurmctld slurmd sbatch srun scontrol squeue scancel sinfo; do
        PATH="$PATH:/usr/sbin:/sbin" command -v "$name" >/dev/null || return 1
    done
}
if ! installed; then
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
        echo "slurm: skipped, Slurm is not installed and installing ${packages[*]} needs root and apt-get"
        exit 0
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
fi
# DeepSpeed's CPU comm op, built now (the other test sessions beside this one may be building it: one waits for the
# other) rather than under the first test's timeout on a loaded machine
python -c "from tests import deepspeed_op; deepspeed_op.use_own_directory(); deepspeed_op.build()"
python -m pytest -m slurm "$@"
