# Sourced by bench/download.sh and bench/download_link.sh, from the repository root:
#   bench_mirror WORK REPO SHARD_MIB SHARDS
# builds the throw-away repo (bench/bench_repo.py) under WORK/root/REPO, serves it with
# the local mirror on 127.0.0.1 and locks it into WORK/lock.json; sets URL (the mirror's)
# and MIRROR_PID (for the caller's trap). Needs PY.
bench_mirror() {
    local work=$1 repo=$2
    PYTHONPATH=. "$PY" bench/bench_repo.py "$work/root/$repo" "$3" "$4"
    "$PY" -m sandbox.mirror serve --root "$work/root" --bind 127.0.0.1 --port 0 \
        --url-file "$work/url" >/dev/null 2>&1 &
    MIRROR_PID=$!
    for _ in $(seq 100); do [ -s "$work/url" ] && break; sleep 0.1; done
    URL=$(cat "$work/url")
    "$PY" -m tools.model_lock "$repo" --base-url "$URL" --out "$work/lock.json" >/dev/null
}
