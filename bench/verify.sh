#!/usr/bin/env bash
# Benchmark the deep model check (files/verify_model.py) against the disk's sequential
# read (cat) of the same files, cold (each file's pages dropped before every run) and
# warm (all in the page cache).
#   bench/verify.sh [DIR=/var/tmp/verify-bench] [FILES=4] [MIB_PER_FILE=1536] [RUNS=5]
# Writes FILES random "shards" of MIB_PER_FILE MiB and their lock into DIR once (kept
# for later runs; rm -r DIR removes them), then prints the median wall time of RUNS runs
# of each command, and the hashing speed as a share of cat's. Cold runs drop only these
# files' pages (posix_fadvise DONTNEED), not the whole machine's page cache.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-/var/tmp/verify-bench}; FILES=${2:-4}; MIB=${3:-1536}; RUNS=${4:-5}
SCRIPT=$PWD/files/verify_model.py
mkdir -p "$DIR/model"
if [ ! -s "$DIR/lock.json" ]; then
  python3 - "$DIR" "$FILES" "$MIB" <<'PYEOF'
import hashlib, json, os, sys
out, files, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
entries = []
for i in range(files):
    name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
    digest, size = hashlib.sha256(), 0
    with open(f"{out}/model/{name}", "wb") as handle:
        for _ in range(mib // 16):
            block = os.urandom(16 << 20)
            handle.write(block)
            digest.update(block)
            size += len(block)
    entries.append({"path": name, "size": size, "algo": "sha256", "digest": digest.hexdigest()})
json.dump({"files": entries}, open(f"{out}/lock.json", "w"), indent=1)
json.dump({"files": entries[:1]}, open(f"{out}/lock1.json", "w"), indent=1)
PYEOF
  sync
fi
cd "$DIR"
ALL=$(python3 -c "import json; print(' '.join('model/' + f['path'] for f in json.load(open('lock.json'))['files']))")
ONE=$(python3 -c "import json; print('model/' + json.load(open('lock1.json'))['files'][0]['path'])")
BYTES=$(python3 -c "import json; print(sum(f['size'] for f in json.load(open('lock.json'))['files']))")
evict() { python3 -c "
import os, sys
for path in sys.argv[1:]:
    fd = os.open(path, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
" "$@"; }
median() {  # median wall seconds of RUNS runs of "$@" (after one warm-up), cold if $COLD
  local times=() s e
  for run in $(seq 0 "$RUNS"); do
    [ -n "${COLD:-}" ] && evict $ALL
    s=$(date +%s.%N); "$@" >/dev/null; e=$(date +%s.%N)
    [ "$run" -gt 0 ] && times+=("$(echo "$e - $s" | bc)")
  done
  printf '%s\n' "${times[@]}" | sort -n | sed -n "$(( (RUNS + 1) / 2 ))p"
}
line() { printf "%-58s %7.2f s %7.0f MiB/s\n" "$1" "$2" "$(echo "$3 / $2 / 1048576" | bc -l)"; }
echo "$(nproc) CPUs; $FILES files, $BYTES bytes in $DIR/model; median of $RUNS runs"
ONE_BYTES=$((BYTES / FILES))
C_CAT=$(COLD=1 median cat $ALL); C_VER=$(COLD=1 median python3 "$SCRIPT" --dest model --lock lock.json)
C_CAT1=$(COLD=1 median cat "$ONE"); C_VER1=$(COLD=1 median python3 "$SCRIPT" --dest model --lock lock1.json --jobs 1)
W_CAT=$(median cat $ALL); W_VER=$(median python3 "$SCRIPT" --dest model --lock lock.json)
line "cold: cat, every file one after the other" "$C_CAT" "$BYTES"
line "cold: verify_model.py, one thread per file up to the CPUs" "$C_VER" "$BYTES"
line "cold: cat, one file" "$C_CAT1" "$ONE_BYTES"
line "cold: verify_model.py --jobs 1, one file" "$C_VER1" "$ONE_BYTES"
line "warm: cat, every file" "$W_CAT" "$BYTES"
line "warm: verify_model.py, one thread per file up to the CPUs" "$W_VER" "$BYTES"
echo "cold, every file: hashing at $(echo "100 * $C_CAT / $C_VER" | bc)% of cat's speed"
echo "cold, one file, one thread: $(echo "100 * $C_CAT1 / $C_VER1" | bc)%"
