#!/usr/bin/env bash
# Debian's slurm-wlm and munge for the Slurm tests (tests/slurm/), installed as root through apt where missing.
# `make test` runs it; tests/slurm/cluster.py runs it when the daemons are missing. Without root or apt it prints
# why and exits 0: the Slurm tests then skip, saying why.
set -u
command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "tests/slurm/install.sh: slurm-wlm and munge not installed (needs root and apt): the Slurm tests will skip"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
{ apt-get update -qq -o Acquire::http::Timeout=10 && apt-get install -y -qq slurm-wlm munge; } >/dev/null 2>&1 \
  || { echo "tests/slurm/install.sh: apt-get install slurm-wlm munge failed: the Slurm tests will skip"; exit 0; }
