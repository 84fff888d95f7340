#!/usr/bin/env bash
# What one of the tests' ssh calls to a sandbox host costs: through the host's shared
# connection (sandbox/hosts.py ssh_argv given the host's directory: OpenSSH's
# ControlMaster) against a connection of its own (key exchange, login). Each call runs
# what the tests' Sandbox.ssh runs (sudo -n sh -c true as the operator), against the
# sandbox's first host; bench/timing.py runs the two in turn after one warm-up each (the
# shared connection is made there). bench/sandbox_ssh.md has the figures.
#
#   .venv/bin/python -m sandbox up --hosts 1
#   bash bench/sandbox_ssh.sh [CALLS]      # default 20 pairs
#
# Root, from the repository root.
set -euo pipefail
PY=.venv/bin/python
call() {  # the ssh command line, shared (1) or not (0)
    "$PY" -c 'import shlex, sys
from sandbox import hosts
host = hosts.Host(**hosts.load_state()["hosts"][0])
argv = hosts.ssh_argv(host.address, host.dir if sys.argv[1] == "1" else None)
print(shlex.join([*argv, "--", "sudo -n sh -c true"]))' "$1"
}
shared=$(call 1)
own=$(call 0)
"$PY" bench/timing.py -n "${1:-20}" --vs "$own" -- sh -c "$shared"
