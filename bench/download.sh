#!/usr/bin/env bash
# Benchmark files/fetch_model.py against curl and sha256sum on the local mirror.
#   bench/download.sh [TOTAL_MIB=1024] [FILES=4] [JOBS=4]
# Builds a throw-away repo (the mirror's tiny Qwen2 plus FILES random LFS shards of
# TOTAL_MIB/FILES MiB each) in a temp dir, serves it on 127.0.0.1, and times:
#   1. curl of every file, FILES in parallel          (network baseline)
#   2. fetch_model.py, --jobs JOBS                     (download + sha256 + fsync)
#   3. sha256sum of the downloaded files               (hash baseline)
#   4. fetch_model.py with .verified.json removed      (first verification, no download)
#   5. fetch_model.py again                            (re-run: stat only)
# Nothing is written under the repo; the temp dir is removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
TOTAL_MIB=${1:-1024}; FILES=${2:-4}; JOBS=${3:-4}
PY=${PY:-.venv/bin/python}
WORK=$(mktemp -d /tmp/bench-download.XXXXXX)
trap 'kill "$MIRROR_PID" 2>/dev/null || true; rm -rf "$WORK"' EXIT
REPO=sandbox/bench-qwen2
"$PY" - "$WORK/root/$REPO" "$TOTAL_MIB" "$FILES" <<'PYEOF'
import json, os, sys
from pathlib import Path
from sandbox.mirror import model
out, total_mib, files = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
manifest = model.generate(out, repo_id="sandbox/bench-qwen2")
for i in range(files):
    with open(out / f"bench-{i:05d}.safetensors", "wb") as f:
        for _ in range(total_mib // files):
            f.write(os.urandom(1 << 20))
names = sorted(p.name for p in out.iterdir() if p.is_file())
manifest["files"] = [model._file_entry(out, n) for n in names]
manifest["total_size"] = sum(f["size"] for f in manifest["files"])
(out / ".mirror/manifest.json").write_text(json.dumps(manifest, indent=1))
config = json.loads((out / "config.json").read_text())
tok = json.loads((out / "tokenizer_config.json").read_text())
(out / ".mirror/api.json").write_text(json.dumps(model.api_response(manifest, config, tok)))
PYEOF
"$PY" -m sandbox.mirror serve --root "$WORK/root" --bind 127.0.0.1 --port 0 \
    --url-file "$WORK/url" >/dev/null 2>&1 &
MIRROR_PID=$!
for _ in $(seq 100); do [ -s "$WORK/url" ] && break; sleep 0.1; done
URL=$(cat "$WORK/url")
"$PY" -m tools.model_lock "$REPO" --base-url "$URL" --out "$WORK/lock.json" >/dev/null
COMMIT=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['commit'])" "$WORK/lock.json")
BYTES=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['total_size'])" "$WORK/lock.json")
LIST=$(cd "$WORK/root/$REPO" && ls -A | grep -vx .mirror)
sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
t() { local s e; s=$(date +%s.%N); "$@" >/dev/null 2>&1; e=$(date +%s.%N); echo "$e - $s" | bc; }
rate() { echo "scale=1; $BYTES / $1 / 1048576" | bc; }
mkdir -p "$WORK/curl"
T_CURL=$(t bash -c "cd '$WORK/curl' && echo '$LIST' | xargs -P $FILES -I{} curl -sf -o {} '$URL/$REPO/resolve/$COMMIT/{}'")
T_FETCH=$(t python3 files/fetch_model.py --lock "$WORK/lock.json" --dest "$WORK/dl" --base-url "$URL" --jobs "$JOBS")
T_SHA=$(t bash -c "cd '$WORK/dl' && sha256sum $(echo $LIST)")
rm "$WORK/dl/.verified.json"
S=$(date +%s.%N); VERIFY_SUMMARY=$(python3 files/fetch_model.py --lock "$WORK/lock.json" --dest "$WORK/dl" --base-url "$URL" --jobs "$JOBS" 2>/dev/null); T_VERIFY=$(echo "$(date +%s.%N) - $S" | bc)
T_RERUN=$(t python3 files/fetch_model.py --lock "$WORK/lock.json" --dest "$WORK/dl" --base-url "$URL" --jobs "$JOBS")
SUMMARY=$(python3 files/fetch_model.py --lock "$WORK/lock.json" --dest "$WORK/dl" --base-url "$URL" --jobs "$JOBS" 2>/dev/null)
echo "files: $(echo $LIST | wc -w), bytes: $BYTES, jobs: $JOBS, $(nproc) CPUs"
printf "%-44s %8.2f s %8s MiB/s\n" "curl (parallel $FILES), download" "$T_CURL" "$(rate $T_CURL)"
printf "%-44s %8.2f s %8s MiB/s\n" "fetch_model.py, download+verify+fsync" "$T_FETCH" "$(rate $T_FETCH)"
printf "%-44s %8.2f s %8s MiB/s\n" "sha256sum (sequential), hash only" "$T_SHA" "$(rate $T_SHA)"
printf "%-44s %8.2f s %8s MiB/s\n" "fetch_model.py, first verification" "$T_VERIFY" "$(rate $T_VERIFY)"
printf "%-44s %8.2f s\n" "fetch_model.py, re-run (.verified.json)" "$T_RERUN"
echo "first-verification summary: $(echo "$VERIFY_SUMMARY" | python3 -c 'import json,sys; d=json.load(sys.stdin); print({k: d[k] for k in ("bytes","hashed_files","hashed_bytes","changed")}, len(d["verified"]), "verified")')"
echo "re-run summary: $(echo "$SUMMARY" | python3 -c 'import json,sys; d=json.load(sys.stdin); print({k: d[k] for k in ("bytes","hashed_files","hashed_bytes","changed")}, len(d["skipped"]), "skipped")')"
