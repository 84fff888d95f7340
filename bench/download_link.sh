#!/usr/bin/env bash
# One large shard through a shaped link (sandbox/relay.py: a rate limit and a delay in
# front of the local mirror): files/fetch_model.py with several Range connections against
# one `curl -o`, run in turn (A B A B ...), each ratio taken pair by pair.
#   bench/download_link.sh [SHARD_MIB=1024] [PAIRS=3] [CONNECTIONS=8] [RATE_MBIT=400] [RTT_MS=40]
# Prints every pair, then the medians: each command's rate against the link's nominal
# rate (RATE_MBIT) and the fetcher's time against curl's. bench/download.md has figures.
# FETCH=path/to/fetch_model.py times another version of the fetcher (an older commit's:
# `git show REV:files/fetch_model.py > /tmp/old.py`) against the same curl.
# Builds its throw-away repo (the tiny Qwen2 plus one random shard) in a temp dir, removed
# at the end; nothing is written under the repo.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARD_MIB=${1:-1024}; PAIRS=${2:-3}; CONN=${3:-8}; RATE=${4:-400}; RTT=${5:-40}
PY=${PY:-.venv/bin/python}
FETCH=${FETCH:-files/fetch_model.py}  # another version of the fetcher, to compare
WORK=$(mktemp -d /var/tmp/bench-link.XXXXXX)
trap 'kill "${MIRROR_PID:-}" "${RELAY_PID:-}" 2>/dev/null || true; rm -rf "$WORK"' EXIT
REPO=sandbox/bench-qwen2
SHARD=bench-00000.safetensors
. bench/bench_mirror.sh
bench_mirror "$WORK" "$REPO" "$SHARD_MIB" 1
"$PY" - "$WORK/lock.json" "$SHARD" <<'PYEOF'
import json, sys
lock = json.load(open(sys.argv[1]))
lock["files"] = [f for f in lock["files"] if f["path"] == sys.argv[2]]
lock["total_size"] = sum(f["size"] for f in lock["files"])
json.dump(lock, open(sys.argv[1], "w"))
PYEOF
COMMIT=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['commit'])" "$WORK/lock.json")
"$PY" -m sandbox.relay --listen 127.0.0.1:0 --to "${URL#http://}" --rtt-ms "$RTT" \
    --rate-mbit "$RATE" > "$WORK/relay" &
RELAY_PID=$!
for _ in $(seq 100); do [ -s "$WORK/relay" ] && break; sleep 0.1; done
SLOW="http://$(head -1 "$WORK/relay" | awk '{print $2}')"
now() { date +%s.%N; }
: > "$WORK/times"
for pair in $(seq "$PAIRS"); do
    rm -rf "$WORK/dl" "$WORK/curl.out"
    s=$(now)
    python3 "$FETCH" --lock "$WORK/lock.json" --dest "$WORK/dl" \
        --base-url "$SLOW" --connections "$CONN" >/dev/null 2>"$WORK/fetch.err"
    m=$(now)
    curl -sf -o "$WORK/curl.out" "$SLOW/$REPO/resolve/$COMMIT/$SHARD"
    e=$(now)
    echo "$pair $s $m $e" >> "$WORK/times"
done
"$PY" - "$WORK/times" "$((SHARD_MIB * 1048576))" "$RATE" "$RTT" "$CONN" <<'PYEOF'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1])]
size, rate_mbit, rtt, conn = int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
link = rate_mbit * 1e6 / 8  # bytes per second
print(f"shard {size} bytes, link {rate_mbit:g} Mbit/s ({link / 1e6:.1f} MB/s), {rtt} ms RTT, "
      f"fetch_model.py --connections {conn} (A) against curl -o (B)")
fetch, curl, ratio = [], [], []
for pair, s, m, e in rows:
    a, b = float(m) - float(s), float(e) - float(m)
    fetch.append(a); curl.append(b); ratio.append(a / b)
    print(f"pair {pair}: A {a:.2f} s ({size / a / 1e6:.1f} MB/s), "
          f"B {b:.2f} s ({size / b / 1e6:.1f} MB/s), A/B {a / b:.3f}")
a, b = statistics.median(fetch), statistics.median(curl)
print(f"median: A {a:.2f} s = {100 * size / a / link:.1f}% of the link; "
      f"B {b:.2f} s = {100 * size / b / link:.1f}% of the link; "
      f"A/B {statistics.median(ratio):.3f} (A at {100 / statistics.median(ratio):.1f}% of B's rate)")
PYEOF
