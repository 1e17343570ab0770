#!/usr/bin/env bash
# Set-up, best effort: Debian's/Ubuntu's bubblewrap, which makes the Python sandbox's namespaces
# (megatron_rlhf/agents/sandbox_isolation.py). Never fails the build: where it cannot be installed
# (not root, no apt-get, no package index) it says how, and a run whose tools run code is refused
# at start-up with the ways out (docs/guide or README, "Tools").
set -u
if command -v bwrap >/dev/null 2>&1; then
  exit 0
fi
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install_sandbox.sh: bwrap (bubblewrap) is not installed and cannot be from here (needs root and apt-get);" \
    "install your OS's bubblewrap package to run model-written code in the isolated sandbox" >&2
  exit 0
fi
log=$(mktemp)
export DEBIAN_FRONTEND=noninteractive
if apt-get install -y -q --no-install-recommends bubblewrap >"$log" 2>&1 ||
  { apt-get update -q >>"$log" 2>&1 && apt-get install -y -q --no-install-recommends bubblewrap >>"$log" 2>&1; }; then
  echo "install_sandbox.sh: installed bubblewrap"
else
  echo "install_sandbox.sh: apt-get could not install bubblewrap (last lines below)" >&2
  tail -n 5 "$log" >&2
fi
rm -f "$log"
exit 0
