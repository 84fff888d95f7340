#!/usr/bin/env bash
# The no-op re-run of deploys/full.py at 0, 20 and 100 ms of round trip (bench/latency.md
# has the figures). This kernel has no netem ("Specified qdisc kind is unknown"), so a
# TCP relay (sandbox/relay.py) delays each direction by half the round trip, in front of
# the host's sshd; pyinfra reaches the host through it.
#
#   python -m sandbox up --hosts 1 --scenario seed
#   pyinfra -y .sandbox/inventory.py deploys/full.py >/dev/null     # converge
#   bash bench/latency.sh [RUNS]
#
# Root, from the repository root. Prints the remote commands of one no-op run, then
# bench/timing.py's pairs: 20 ms against 0 ms, and 100 ms against 0 ms (medians and ratios).
set -euo pipefail
PY=.venv/bin/python
PYINFRA=.venv/bin/pyinfra
INV=.sandbox/inventory.py
RUNS=${1:-5}
HOST=$($PY -c 'import json; print(json.load(open(".sandbox/state.json"))["hosts"][0]["address"])')
relays=()
port_for() {  # start a relay with RTT $1 ms; print its port
    local out
    out=$(mktemp)
    $PY -m sandbox.relay --listen 127.0.0.1:0 --to "$HOST:22" --rtt-ms "$1" >"$out" &
    relays+=($!)
    for _ in $(seq 50); do grep -q '^relay ' "$out" && break; sleep 0.1; done
    sed -n 's/^relay 127.0.0.1:\([0-9]*\) .*/\1/p' "$out"
}
trap 'kill "${relays[@]}" 2>/dev/null || true' EXIT
P0=$(port_for 0); P20=$(port_for 20); P100=$(port_for 100)
through() { echo "$PYINFRA -y $INV deploys/full.py --data ssh_hostname=127.0.0.1 --data ssh_port=$1 --data ssh_strict_host_key_checking=no"; }

echo "remote commands in one no-op run: $($(through "$P0") -vvv 2>&1 | grep -c '>>> ' || true)"
$(through "$P20") --json | $PY -c 'import json,sys; print("20 ms, totals:", json.load(sys.stdin)["results"]["totals"])'
python3 bench/timing.py -n "$RUNS" --timeout 1800 --vs "$(through "$P0")" -- $(through "$P20")
python3 bench/timing.py -n "$RUNS" --timeout 1800 --vs "$(through "$P0")" -- $(through "$P100")
