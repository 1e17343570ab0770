#!/usr/bin/env bash
# Test set-up, best effort: Debian's slurm-wlm and munge for the single-node Slurm test in
# tests/test_launch.py. Never fails the build: where Slurm cannot be installed (not root, no
# apt-get, no package index), it says so and that test is skipped with the reason.
set -u
if command -v slurmctld >/dev/null 2>&1 || [[ -x /usr/sbin/slurmctld ]]; then
  exit 0
fi
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
  echo "setup_slurm.sh: Slurm not installed and cannot install it (needs root and apt-get); its test will be skipped" >&2
  exit 0
fi
log=$(mktemp)
export DEBIAN_FRONTEND=noninteractive
if apt-get install -y -q --no-install-recommends slurm-wlm munge >"$log" 2>&1 ||
  { apt-get update -q >>"$log" 2>&1 && apt-get install -y -q --no-install-recommends slurm-wlm munge >>"$log" 2>&1; }; then
  echo "setup_slurm.sh: installed slurm-wlm and munge"
else
  echo "setup_slurm.sh: apt-get could not install slurm-wlm and munge (last lines below); its test will be skipped" >&2
  tail -n 5 "$log" >&2
fi
rm -f "$log"
exit 0
