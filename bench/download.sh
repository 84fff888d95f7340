#!/usr/bin/env bash
# Benchmark files/fetch_model.py against curl, sha256sum and aria2c on the local mirror,
# over loopback and through sandbox/relay.py (a shaped link: rate limit and delay).
#   bench/download.sh [TOTAL_MIB=1024] [FILES=4] [JOBS=4] [CONNECTIONS=8] [RATE_MBIT=400] [RTT_MS=40]
# Builds a throw-away repo (the mirror's tiny Qwen2 plus FILES random LFS shards of
# TOTAL_MIB/FILES MiB each) in a temp dir, serves it on 127.0.0.1, and times:
#   1. curl of every file, FILES in parallel          (network baseline)
#   2. fetch_model.py, --jobs JOBS                     (download + sha256 + fsync)
#   3. sha256sum of the downloaded files               (hash baseline)
#   4. fetch_model.py with .verified.json removed      (first verification, no download)
#   5. fetch_model.py again                            (re-run: stat only)
#   6. curl | sha256sum, FILES in parallel              (download + hash, no fsync)
#   7. aria2c -x CONNECTIONS, FILES in parallel         (if installed: Debian's aria2)
#   8. fetch_model.py --connections 1                   (one connection per file)
#   9. through the relay (RATE_MBIT, RTT_MS): curl -o of the first shard, then
#      fetch_model.py --connections CONNECTIONS of it alone (its own lock)
# Nothing is written under the repo; the temp dir is removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
TOTAL_MIB=${1:-1024}; FILES=${2:-4}; JOBS=${3:-4}; CONN=${4:-8}; RATE=${5:-400}; RTT=${6:-40}
PY=${PY:-.venv/bin/python}
WORK=$(mktemp -d /tmp/bench-download.XXXXXX)
trap 'kill "$MIRROR_PID" "${RELAY_PID:-}" 2>/dev/null || true; rm -rf "$WORK"' EXIT
REPO=sandbox/bench-qwen2
. bench/bench_mirror.sh
bench_mirror "$WORK" "$REPO" "$((TOTAL_MIB / FILES))" "$FILES"
COMMIT=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['commit'])" "$WORK/lock.json")
BYTES=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['total_size'])" "$WORK/lock.json")
LIST=$(cd "$WORK/root/$REPO" && ls -A | grep -vx .mirror)
sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
t() { local s e; s=$(date +%s.%N); "$@" >/dev/null 2>&1; e=$(date +%s.%N); echo "$e - $s" | bc; }
rate() { echo "scale=1; $BYTES / $1 / 1048576" | bc; }
mkdir -p "$WORK/curl"
T_CURL=$(t bash -c "cd '$WORK/curl' && echo '$LIST' | xargs -P $FILES -I{} curl -sf -o {} '$URL/$REPO/resolve/$COMMIT/{}'")
T_FETCH=$(t python3 files/fetch_model.py --lock "$WORK/lock.json" --dest "$WORK/dl" --base-url "$URL" --jobs "$JOBS" --connections "$CONN")
T_CSHA=$(t bash -c "echo '$LIST' | xargs -P $FILES -I{} sh -c \"curl -sf '$URL/$REPO/resolve/$COMMIT/{}' | sha256sum\"")
T_ARIA=
if command -v aria2c >/dev/null; then
  echo "$LIST" | sed "s#^#$URL/$REPO/resolve/$COMMIT/#" > "$WORK/aria.list"
  T_ARIA=$(t aria2c -q -j "$FILES" -x "$CONN" -s "$CONN" -d "$WORK/aria" -i "$WORK/aria.list")
fi
T_ONE=$(t python3 files/fetch_model.py --lock "$WORK/lock.json" --dest "$WORK/dl1c" --base-url "$URL" --jobs "$JOBS" --connections 1)
rm -rf "$WORK/curl" "$WORK/aria" "$WORK/dl1c"
T_SHA=$(t bash -c "cd '$WORK/dl' && sha256sum $(echo $LIST)")
rm "$WORK/dl/.verified.json"
S=$(date +%s.%N); VERIFY_SUMMARY=$(python3 files/fetch_model.py --lock "$WORK/lock.json" --dest "$WORK/dl" --base-url "$URL" --jobs "$JOBS" 2>/dev/null); T_VERIFY=$(echo "$(date +%s.%N) - $S" | bc)
T_RERUN=$(t python3 files/fetch_model.py --lock "$WORK/lock.json" --dest "$WORK/dl" --base-url "$URL" --jobs "$JOBS")
SUMMARY=$(python3 files/fetch_model.py --lock "$WORK/lock.json" --dest "$WORK/dl" --base-url "$URL" --jobs "$JOBS" 2>/dev/null)
# The shaped link: the relay in front of the mirror, one shard alone.
SHARD=bench-00000.safetensors
"$PY" -c "import json,sys; l=json.load(open(sys.argv[1])); l['files']=[f for f in l['files'] if f['path']==sys.argv[2]]; json.dump(l, open(sys.argv[3],'w'))" "$WORK/lock.json" "$SHARD" "$WORK/lock1.json"
SHARD_BYTES=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['files'][0]['size'])" "$WORK/lock1.json")
"$PY" -m sandbox.relay --listen 127.0.0.1:0 --to "${URL#http://}" --rtt-ms "$RTT" --rate-mbit "$RATE" > "$WORK/relay" &
RELAY_PID=$!
for _ in $(seq 100); do [ -s "$WORK/relay" ] && break; sleep 0.1; done
SLOW="http://$(head -1 "$WORK/relay" | awk '{print $2}')"
T_SCURL=$(t curl -sf -o "$WORK/shard" "$SLOW/$REPO/resolve/$COMMIT/$SHARD")
T_SFETCH=$(t python3 files/fetch_model.py --lock "$WORK/lock1.json" --dest "$WORK/slow" --base-url "$SLOW" --connections "$CONN")
echo "files: $(echo $LIST | wc -w), bytes: $BYTES, jobs: $JOBS, connections: $CONN, $(nproc) CPUs"
printf "%-44s %8.2f s %8s MiB/s\n" "curl (parallel $FILES), download" "$T_CURL" "$(rate $T_CURL)"
printf "%-44s %8.2f s %8s MiB/s\n" "fetch_model.py, download+verify+fsync" "$T_FETCH" "$(rate $T_FETCH)"
printf "%-44s %8.2f s %8s MiB/s\n" "curl | sha256sum (parallel $FILES)" "$T_CSHA" "$(rate $T_CSHA)"
[ -n "$T_ARIA" ] && printf "%-44s %8.2f s %8s MiB/s\n" "aria2c -x $CONN (parallel $FILES), download" "$T_ARIA" "$(rate $T_ARIA)"
printf "%-44s %8.2f s %8s MiB/s\n" "fetch_model.py --connections 1" "$T_ONE" "$(rate $T_ONE)"
printf "%-44s %8.2f s %8s MiB/s\n" "sha256sum (sequential), hash only" "$T_SHA" "$(rate $T_SHA)"
printf "%-44s %8.2f s %8s MiB/s\n" "fetch_model.py, first verification" "$T_VERIFY" "$(rate $T_VERIFY)"
printf "%-44s %8.2f s\n" "fetch_model.py, re-run (.verified.json)" "$T_RERUN"
echo "first-verification summary: $(echo "$VERIFY_SUMMARY" | python3 -c 'import json,sys; d=json.load(sys.stdin); print({k: d[k] for k in ("bytes","hashed_files","hashed_bytes","changed")}, len(d["verified"]), "verified")')"
echo "re-run summary: $(echo "$SUMMARY" | python3 -c 'import json,sys; d=json.load(sys.stdin); print({k: d[k] for k in ("bytes","hashed_files","hashed_bytes","changed")}, len(d["skipped"]), "skipped")')"
link=$(echo "scale=2; $RATE * 1000000 / 8 / 1048576" | bc)
echo "through the relay: $RATE Mbit/s ($link MiB/s), $RTT ms RTT, $SHARD ($SHARD_BYTES bytes)"
printf "%-44s %8.2f s %8s MiB/s\n" "curl -o" "$T_SCURL" "$(echo "scale=1; $SHARD_BYTES / $T_SCURL / 1048576" | bc)"
printf "%-44s %8.2f s %8s MiB/s\n" "fetch_model.py --connections $CONN" "$T_SFETCH" "$(echo "scale=1; $SHARD_BYTES / $T_SFETCH / 1048576" | bc)"
