"""The mirror's HTTP side: Hub layout, ranges, token, fault switch and counters.

All traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sandbox.mirror.server import MirrorServer, RangeNotSatisfiable, parse_range

REPO = "sandbox/tiny-qwen2"
SHARD = "model-00002-of-00004.safetensors"
TOKEN = "tok-1234-secret"


@pytest.fixture(scope="module")
def root(mirror_root: Path) -> Path:
    return mirror_root


@pytest.fixture(autouse=True)
def clean_state(request):
    """Each test starts with no faults and zeroed counters on the shared server."""
    if "mirror" in request.fixturenames:
        server = request.getfixturevalue("mirror")
        server.faults.clear()
        server.stats.reset()


def call(server: MirrorServer, method: str, path: str, headers: dict[str, str] | None = None,
         body: object = None) -> tuple[int, http.client.HTTPMessage, bytes, bool]:
    """One request on a fresh connection: (status, headers, body, body_was_complete)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    data = json.dumps(body).encode() if body is not None else None
    try:
        conn.request(method, path, body=data, headers=headers or {})
        resp = conn.getresponse()
        try:
            return resp.status, resp.headers, resp.read(), True
        except http.client.IncompleteRead as short:
            return resp.status, resp.headers, short.partial, False
    finally:
        conn.close()


def resolve(name: str, revision: str = "main") -> str:
    return f"/{REPO}/resolve/{revision}/{name}"


def entry(server: MirrorServer, name: str) -> dict:
    return server.repos[REPO].files[name]


def file_bytes(root: Path, name: str) -> bytes:
    return (root / REPO / name).read_bytes()


# --- plain downloads ---------------------------------------------------------------------

@pytest.mark.parametrize("name", [SHARD, "config.json"])
def test_full_get_and_headers(mirror, root, name):
    status, headers, body, complete = call(mirror, "GET", resolve(name))
    meta = entry(mirror, name)
    assert (status, complete) == (200, True) and body == file_bytes(root, name)
    assert headers["Content-Length"] == str(len(body))
    assert headers["X-Repo-Commit"] == mirror.repos[REPO].sha
    assert headers["Accept-Ranges"] == "bytes"
    if meta["lfs"]:
        assert headers["ETag"] == headers["X-Linked-Etag"] == f'"{meta["sha256"]}"'
        assert headers["X-Linked-Size"] == str(meta["size"])
    else:
        assert headers["ETag"] == f'"{meta["git_sha1"]}"' and "X-Linked-Etag" not in headers


def test_revision_may_be_the_commit_sha(mirror, root):
    status, _, body, _ = call(mirror, "GET", resolve("config.json", mirror.repos[REPO].sha))
    assert status == 200 and body == file_bytes(root, "config.json")


@pytest.mark.parametrize("path,code", [
    (resolve("nope.bin"), "EntryNotFound"),
    (resolve("config.json", "v9"), "RevisionNotFound"),
    ("/other/repo/resolve/main/config.json", "RepoNotFound"),
    ("/sandbox/tiny-qwen2/resolve/main/.mirror/manifest.json", "EntryNotFound"),
])
def test_not_found(mirror, path, code):
    status, headers, _, _ = call(mirror, "GET", path)
    assert status == 404 and headers["X-Error-Code"] == code


def test_head_has_headers_and_no_body(mirror):
    status, headers, body, _ = call(mirror, "HEAD", resolve(SHARD))
    meta = entry(mirror, SHARD)
    assert status == 200 and body == b""
    assert headers["Content-Length"] == str(meta["size"])
    assert headers["X-Linked-Etag"] == f'"{meta["sha256"]}"'
    assert mirror.stats.snapshot()["files"][f"{REPO}/{SHARD}"]["head"] == 1


# --- ranges ------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,start,end", [
    ("bytes=100-199", 100, 200),
    ("bytes=1000000-", 1000000, None),
    ("bytes=-4096", -4096, None),
    ("bytes=0-99999999", 0, None),  # last byte past the end is clamped
])
def test_range_206(mirror, root, spec, start, end):
    data = file_bytes(root, SHARD)
    expected = data[start:end]
    status, headers, body, _ = call(mirror, "GET", resolve(SHARD), {"Range": spec})
    first = len(data) + start if start < 0 else start
    assert status == 206 and body == expected
    assert headers["Content-Range"] == f"bytes {first}-{first + len(expected) - 1}/{len(data)}"
    assert headers["Content-Length"] == str(len(expected))


@pytest.mark.parametrize("spec", ["bytes=99999999-", "bytes=-0"])
def test_range_416(mirror, spec):
    status, headers, _, _ = call(mirror, "GET", resolve(SHARD), {"Range": spec})
    assert status == 416 and headers["Content-Range"] == f"bytes */{entry(mirror, SHARD)['size']}"


def test_unsupported_range_gets_whole_file(mirror, root):
    status, _, body, _ = call(mirror, "GET", resolve("vocab.json"), {"Range": "bytes=0-1,5-9"})
    assert status == 200 and body == file_bytes(root, "vocab.json")


@pytest.mark.parametrize("header,expected", [
    (None, None), ("items=0-1", None), ("bytes=5-2", None), ("bytes=x-", None), ("bytes=-", None),
    ("bytes=0-0", (0, 1)), ("bytes=9-", (9, 10)), ("bytes=-3", (7, 10)), ("bytes=-30", (0, 10)),
])
def test_parse_range(header, expected):
    assert parse_range(header, 10) == expected


def test_parse_range_unsatisfiable():
    with pytest.raises(RangeNotSatisfiable):
        parse_range("bytes=10-", 10)


# --- fault switch ------------------------------------------------------------------------

def arm(mirror, **spec) -> dict:
    status, _, body, _ = call(mirror, "POST", "/_faults", body=spec)
    assert status == 201, body
    return json.loads(body)["fault"]


def test_drop_once_then_resume(mirror, root):
    arm(mirror, path=SHARD, mode="drop", after_bytes=500000, times=1)
    data = file_bytes(root, SHARD)
    status, headers, body, complete = call(mirror, "GET", resolve(SHARD))
    assert status == 200 and not complete and len(body) == 500000
    assert headers["Content-Length"] == str(len(data))  # promised more than it sent
    status, _, rest, complete = call(mirror, "GET", resolve(SHARD), {"Range": "bytes=500000-"})
    assert status == 206 and complete and body + rest == data
    status, _, again, complete = call(mirror, "GET", resolve(SHARD))
    assert complete and again == data  # the fault was used up
    stats = mirror.stats.snapshot()
    assert stats["files"][f"{REPO}/{SHARD}"]["bytes_sent"] == 500000 + len(rest) + len(data)
    assert stats["faults_fired"] == 1


def test_corrupt_flips_exactly_one_byte(mirror, root):
    arm(mirror, path=SHARD, mode="corrupt", offset=12345, times=1)
    data = file_bytes(root, SHARD)
    # A range that does not cover the offset leaves the fault armed.
    partial = call(mirror, "GET", resolve(SHARD), {"Range": "bytes=20000-20999"})[2]
    assert partial == data[20000:21000]
    _, _, body, complete = call(mirror, "GET", resolve(SHARD))
    assert complete and len(body) == len(data)
    assert [i for i in range(len(data)) if body[i] != data[i]] == [12345]
    assert call(mirror, "GET", resolve(SHARD))[2] == data


def test_status_fault_and_always(mirror, root):
    arm(mirror, path="config.json", mode="status", status=503, times=-1)
    for _ in range(3):
        assert call(mirror, "GET", resolve("config.json"))[0] == 503
    assert call(mirror, "GET", resolve("vocab.json"))[0] == 200  # other files untouched
    assert call(mirror, "DELETE", "/_faults")[0] == 200
    assert call(mirror, "GET", resolve("config.json"))[2] == file_bytes(root, "config.json")


def test_fault_listing_and_validation(mirror):
    arm(mirror, mode="drop", after_bytes=1, times=2)
    listed = json.loads(call(mirror, "GET", "/_faults")[2])["faults"]
    assert [(f["mode"], f["times"], f["path"]) for f in listed] == [("drop", 2, None)]
    for bad in ({"mode": "explode"}, {"mode": "drop", "times": 0}, {"mode": "drop", "x": 1},
                {"mode": "corrupt", "offset": -1}):
        assert call(mirror, "POST", "/_faults", body=bad)[0] == 400


def timed(mirror, path: str, headers: dict[str, str] | None = None
          ) -> tuple[int, bytes, bool, float]:
    """One request: (status, body, complete, seconds from the request to its last byte)."""
    began = time.monotonic()
    status, _, body, complete = call(mirror, "GET", path, headers)
    return status, body, complete, time.monotonic() - began


@pytest.mark.parametrize("spec,rate,status", [
    (None, 1_000_000, 200),  # the whole shard (1,708,624 bytes): 1.71 s
    ("bytes=100000-699999", 200_000, 206),  # 600,000 bytes from the middle: 3.0 s
])
def test_slow_paces_the_body_at_its_rate(mirror, root, spec, rate, status):
    data = file_bytes(root, SHARD)
    expected = data[100000:700000] if spec else data
    arm(mirror, path=SHARD, mode="slow", rate=rate, times=1)
    got, body, complete, seconds = timed(mirror, resolve(SHARD), {"Range": spec} if spec else {})
    assert (got, complete, body == expected) == (status, True, True)
    assert seconds == pytest.approx(len(expected) / rate, rel=0.15)
    assert mirror.faults.snapshot() == []  # spent by that one response
    assert timed(mirror, resolve(SHARD))[3] < 0.5  # the next one is not paced
    assert mirror.stats.snapshot()["faults_fired"] == 1


def test_slow_paces_each_connection_alone(mirror, root):
    # What a downloader's several Range connections per file see: each at the rate, so two
    # of them together fetch at twice the rate.
    data = file_bytes(root, SHARD)
    arm(mirror, path=SHARD, mode="slow", rate=200_000, times=-1)
    spans = [(0, 300_000), (300_000, 600_000)]
    results: dict[int, tuple[int, bytes, bool, float]] = {}

    def fetch(first: int, end: int) -> None:
        results[first] = timed(mirror, resolve(SHARD), {"Range": f"bytes={first}-{end - 1}"})

    threads = [threading.Thread(target=fetch, args=span) for span in spans]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    wall = time.monotonic() - began
    for first, end in spans:
        status, body, complete, seconds = results[first]
        assert (status, complete, body == data[first:end]) == (206, True, True)
        assert seconds == pytest.approx(1.5, rel=0.15)
    assert wall < 2.0  # together, not one after the other (3 s)
    # A HEAD has no body to pace, other files are not matched, and -1 stays armed.
    started = time.monotonic()
    assert call(mirror, "HEAD", resolve(SHARD))[0] == 200
    assert call(mirror, "GET", resolve("tokenizer.json"))[0] == 200
    assert time.monotonic() - started < 0.5
    assert [(f["mode"], f["rate"], f["times"], f["fired"]) for f in mirror.faults.snapshot()] \
        == [("slow", 200_000, -1, 2)]


@pytest.mark.parametrize("spec,message", [
    ({"mode": "slow"}, "rate must be > 0 for mode slow (body bytes per second, e.g. 200000), "
                       "got 0"),
    ({"mode": "slow", "rate": 0}, "rate must be > 0 for mode slow"),
    ({"mode": "slow", "rate": -200}, "rate must be > 0 for mode slow (body bytes per second, "
                                     "e.g. 200000), got -200"),
    ({"mode": "slow", "rate": "fast"}, "rate must be an integer, got 'fast'"),
    ({"mode": "slow", "rate": 1.5}, "rate must be an integer, got 1.5"),
    ({"mode": "slow", "rate": True}, "rate must be an integer, got True"),
    ({"mode": "drop", "after_bytes": 1, "rate": 100}, "rate applies to mode slow only, not drop"),
    ({"mode": "slow", "rate": 100, "times": 0}, "times must be -1 (always) or a positive count"),
])
def test_slow_refuses_a_bad_rate(mirror, spec, message):
    status, headers, body, _ = call(mirror, "POST", "/_faults", body=spec)
    assert (status, headers["X-Error-Code"]) == (400, "BadRequest")
    assert message in json.loads(body)["error"]
    assert mirror.faults.snapshot() == []


# --- counters and API --------------------------------------------------------------------

def test_stats_count_requests_and_bytes(mirror, root):
    assert json.loads(call(mirror, "GET", "/_stats")[2])["totals"] == {
        "get": 0, "head": 0, "bytes_sent": 0}
    call(mirror, "GET", resolve("config.json"))
    call(mirror, "GET", resolve("config.json"), {"Range": "bytes=0-9"})
    stats = json.loads(call(mirror, "GET", "/_stats")[2])
    assert stats["files"][f"{REPO}/config.json"] == {
        "get": 2, "head": 0, "ranged": 1,
        "bytes_sent": len(file_bytes(root, "config.json")) + 10}
    assert call(mirror, "DELETE", "/_stats")[0] == 200
    assert mirror.stats.snapshot()["files"] == {}


def test_api_model_info(mirror):
    sha = mirror.repos[REPO].sha
    status, _, body, _ = call(mirror, "GET", f"/api/models/{REPO}/revision/main?blobs=true")
    info = json.loads(body)
    assert status == 200 and info["sha"] == sha
    shard = next(s for s in info["siblings"] if s["rfilename"] == SHARD)
    assert shard["lfs"]["sha256"] == entry(mirror, SHARD)["sha256"]
    assert shard["blobId"] == entry(mirror, SHARD)["blob_id"]
    plain = json.loads(call(mirror, "GET", f"/api/models/{REPO}/revision/{sha}")[2])
    assert all(set(s) == {"rfilename"} for s in plain["siblings"])
    assert json.loads(call(mirror, "GET", f"/api/models/{REPO}")[2])["sha"] == sha
    assert mirror.stats.snapshot()["api"] == 3


# --- token -------------------------------------------------------------------------------

def test_token_gates_repo_requests(root, capsys):
    with MirrorServer(root, token=TOKEN, quiet=False) as gated:
        status, headers, _, _ = call(gated, "GET", resolve("config.json"))
        assert status == 401 and headers["X-Error-Code"] == "GatedRepo"
        assert call(gated, "HEAD", resolve(SHARD))[0] == 401
        assert call(gated, "GET", f"/api/models/{REPO}")[0] == 401
        wrong = {"Authorization": "Bearer wrong"}
        assert call(gated, "GET", resolve("config.json"), wrong)[0] == 401
        good = {"Authorization": f"Bearer {TOKEN}"}
        assert call(gated, "GET", resolve("config.json"), good)[0] == 200
        assert call(gated, "GET", f"/api/models/{REPO}", good)[0] == 200
        assert call(gated, "GET", "/_stats")[0] == 200  # test controls are not gated
        assert gated.stats.snapshot()["unauthorized"] == 4
    logged = capsys.readouterr()
    assert "resolve/main/config.json" in logged.err  # it did log, and
    assert TOKEN not in logged.err + logged.out  # never the token


# --- command line ------------------------------------------------------------------------

def test_cli_serve_generates_prints_url_and_stops(tmp_path):
    pid_file = tmp_path / "mirror.pid"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandbox.mirror", "serve", "--root", str(tmp_path / "root"),
         "--bind", "127.0.0.1", "--port", "0", "--pid-file", str(pid_file)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parents[2], env={**os.environ, "PYTHONPATH": "."})
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), proc.stderr.read()
        port = int(url.rsplit(":", 1)[1])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", f"/{REPO}/resolve/main/config.json")
        assert conn.getresponse().status == 200
        conn.close()
        assert pid_file.read_text().strip() == str(proc.pid)
        assert (tmp_path / "root" / REPO / ".mirror" / "manifest.json").is_file()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    deadline = time.monotonic() + 2
    while pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_file.exists()
