#!/usr/bin/env bash
# Runs CMD... inside a network namespace of its own, kst-<pid>: loopback up and nothing else (no route anywhere),
# so whatever CMD sends stays on this machine. Removed afterwards; exits with CMD's status.
#   scripts/isolated.sh .venv/bin/python -m pytest -x -q tests/runtime/test_network.py
# Entered with nsenter --net, not `ip netns exec`: that one remounts /sys, which breaks the cgroups gVisor uses.
# Inside, KEEPSTATE_ISOLATED_NETNS names the namespace. A fake internet (keepstate.testing.internet) can then be
# linked in as the only way out.
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 CMD [ARG...]" >&2; exit 2; }
ns=kst-$$
ip netns add "$ns"
trap 'ip netns del "$ns" 2>/dev/null || true' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
nsenter --net="/run/netns/$ns" ip link set lo up
status=0
KEEPSTATE_ISOLATED_NETNS=$ns nsenter --net="/run/netns/$ns" "$@" || status=$?
exit $status
