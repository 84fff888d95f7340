"""The HTML audit report in a real browser: Debian's headless Chromium renders it, the
screenshot is decoded (stdlib zlib, no image library) and must show the page, the
matrix's colours included; the browser's console must stay free of errors (a Content
Security Policy refusal, a script error); the DOM it built must hold every host and the
SVG matrices.

Needs the ``chromium`` package (the Makefile's system-deps installs it); skipped without
it. ``--no-sandbox``: Chromium's sandbox cannot start as root, which CI runs as.
The screenshot stays in pytest's temporary directory; its path is printed (-s shows it).
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from collections import Counter
from pathlib import Path

import pytest

from pyinfra_vllm.report.changes import changes
from pyinfra_vllm.report.html_page import LINK_KINDS, render_html
from pyinfra_vllm.report.summary import summary_rows
from tests.unit.fleet_reports import fleet, previous_of

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (make system-deps installs it)")
WIDTH, HEIGHT = 1400, 1000


def chromium(tmp_path: Path, page: Path, *options: str) -> subprocess.CompletedProcess:
    command = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu",
               "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
               "--enable-logging=stderr", "--v=0", *options, page.as_uri()]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)


def console_errors(stderr: str) -> list[str]:
    """The page's console messages and uncaught errors in Chromium's log."""
    return [line for line in stderr.splitlines()
            if "CONSOLE" in line or "Uncaught" in line or "Content Security Policy" in line]


def png_pixels(path: Path) -> tuple[int, int, list[tuple[int, ...]]]:
    """(width, height, RGB pixels) of an 8-bit RGB or RGBA PNG (PNG spec, ISO/IEC 15948)."""
    data = path.read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path}: not a PNG")
    at, idat, header = 8, b"", b""
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat += body
        at += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", header[:10])
    if depth != 8 or colour not in (2, 6):
        raise ValueError(f"{path}: bit depth {depth}, colour type {colour}: not 8-bit RGB(A)")
    channels = 3 if colour == 2 else 4
    stride = width * channels
    raw = zlib.decompress(idat)
    previous = bytearray(stride)
    pixels = []
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up = previous[i]
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                corner = previous[i - channels] if i >= channels else 0
                guess = left + up - corner
                a, b, c = abs(guess - left), abs(guess - up), abs(guess - corner)
                line[i] = (line[i] + (left if a <= b and a <= c else up if b <= c else corner)) & 0xFF
        pixels += [tuple(line[x : x + 3]) for x in range(0, stride, channels)]
        previous = line
    return width, height, pixels


def rgb(colour: str) -> tuple[int, ...]:
    return tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5))


def painted(counts: Counter, colour: str) -> int:
    """Pixels of ``colour``, give or take the rounding of a PNG encoder."""
    want = rgb(colour)
    return sum(n for pixel, n in counts.items()
               if all(abs(a - b) <= 6 for a, b in zip(pixel, want, strict=True)))


@pytest.fixture
def page(tmp_path) -> Path:
    report = fleet()
    report["changes"] = changes(previous_of(report), report, "audit-20261130T100000Z.json")
    path = tmp_path / "audit-20261201T100000Z.html"
    path.write_text(render_html(report, summary_rows(report)))
    return path


def test_chromium_renders_the_report(tmp_path, page):
    shot = tmp_path / "audit-report.png"
    run = chromium(tmp_path, page, f"--screenshot={shot}", f"--window-size={WIDTH},{HEIGHT}")
    print(f"\nscreenshot of the HTML audit report: {shot}")
    assert run.returncode == 0, run.stderr[-2000:]
    assert console_errors(run.stderr) == []
    width, height, pixels = png_pixels(shot)
    assert (width, height) == (WIDTH, HEIGHT)
    counts = Counter(pixels)
    ink = len(pixels) - counts[(255, 255, 255)]
    # Text, the coloured table rows and the first matrix: far from a blank page.
    assert ink > WIDTH * HEIGHT // 20, f"{ink} non-white pixels of {WIDTH * HEIGHT}"
    # The fleet table's row colours, all in the first screen.
    for css in ("#fff4d6", "#e6f4ea", "#fde2e1"):
        assert painted(counts, css) > 2000, css


def test_the_matrix_is_painted_in_its_colours(tmp_path, page):
    # Tall enough to hold the first host's matrix (8 GPUs, 10 NICs).
    shot = tmp_path / "audit-report-matrix.png"
    run = chromium(tmp_path, page, f"--screenshot={shot}", f"--window-size={WIDTH},2600")
    print(f"\nscreenshot of the HTML audit report, matrix: {shot}")
    assert run.returncode == 0, run.stderr[-2000:]
    counts = Counter(png_pixels(shot)[2])
    cell = 44 * 44  # a matrix cell, its white border aside
    found = {kind: painted(counts, LINK_KINDS[kind][0]) for kind in ("NV#", "PXB", "PIX", "SYS", "X")}
    # The DGX's 56 NV12 cells, 36 PXB, 2 PIX between NIC8 and NIC9, 18 on the diagonal.
    assert found["NV#"] > 50 * cell * 0.8, found
    assert found["PXB"] > 30 * cell * 0.8, found
    assert found["PIX"] > 2 * cell * 0.8, found
    assert found["SYS"] > 150 * cell * 0.8, found
    assert found["X"] > 18 * cell * 0.8, found


def test_the_dom_holds_every_host_and_the_matrices(tmp_path, page):
    run = chromium(tmp_path, page, "--dump-dom")
    assert run.returncode == 0, run.stderr[-2000:]
    dom = run.stdout
    for name in ("gpu-dgx-01", "gpu-h200-01", "gpu-pcie-01"):
        assert f">{name}</a>" in dom and f"<h2>{name} " in dom
    assert dom.count('class="matrix"') == 3
    assert "Changed since the previous audit" in dom
    assert console_errors(run.stderr) == []


def test_the_console_check_sees_an_error(tmp_path, page):
    # The same page with a script: its policy refuses it, and the console says so.
    page.write_text(page.read_text().replace("</body>", "<script>window.x = 1</script></body>"))
    run = chromium(tmp_path, page, "--dump-dom")
    assert run.returncode == 0, run.stderr[-2000:]
    errors = console_errors(run.stderr)
    assert errors and "Content Security Policy" in errors[0], run.stderr[-2000:]
