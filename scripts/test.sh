#!/usr/bin/env bash
# Quick start, command 2: set up, lint and type-check, then run the whole test suite on real
# engine pools.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# From Debian, when missing (root only; without them those tests skip and say why):
# Chromium for the browser tests (one renders the saved dashboard, one drives notebook 1 in
# JupyterLab through Playwright; no browser download), Open MPI for the MPI-launched pool,
# OpenSSH's server for the pool whose engines start through ssh on two namespace hosts, Slurm
# (slurmctld, slurmd, its client commands) and munge for the pool submitted as a Slurm job.
missing=()
command -v chromium >/dev/null || missing+=(chromium)
command -v mpiexec >/dev/null || missing+=(openmpi-bin)
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
[ -x /usr/sbin/slurmctld ] || missing+=(slurmctld)
[ -x /usr/sbin/slurmd ] || missing+=(slurmd)
command -v sbatch >/dev/null || missing+=(slurm-client)
[ -x /usr/sbin/munged ] || missing+=(munge)
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing ${missing[*]} from Debian for the browser and multi-host tests (a minute or two)"
  { apt-get update -qq >/dev/null && apt-get install -y -qq "${missing[@]}" >/dev/null; } ||
    echo "could not install ${missing[*]}: the tests that need them will be skipped"
fi
.venv/bin/python -m ruff check sagenb tests benchmarks
.venv/bin/python -m mypy sagenb benchmarks  # [tool.mypy] in pyproject.toml; ~1 min cold, 3 s cached
exec .venv/bin/python -m pytest "$@"
