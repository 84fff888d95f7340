"""The GPUs' health in the audit's reports: the digest's words, the Markdown section and
the counters that moved since the previous audit."""

from __future__ import annotations

from pyinfra_vllm.core.settings import validate
from pyinfra_vllm.report.changes import change_words, changes
from pyinfra_vllm.report.markdown import render_markdown
from pyinfra_vllm.report.verdicts import summarize
from tests.unit.test_checks import XID_79, seed_state

SETTINGS = validate({"gateway_open": True})


def q_record(bus_id: str, index: int, correctable: int) -> dict:
    return {"bus_id": bus_id, "index": index, "name": "NVIDIA A100 80GB PCIe",
            "ecc_mode": "Enabled",
            "ecc": {"volatile": {"correctable": correctable, "uncorrectable": 0},
                    "aggregate": {"correctable": correctable, "uncorrectable": 0},
                    "pending": False},
            "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": False,
                              "failure": False},
            "retired_pages": {"single_bit": None, "double_bit": None, "pending": None},
            "clocks_event_reasons": {"active": ["idle"], "counters_us": None},
            "pcie": {"gen_current": 4, "gen_max": 4, "width_current": 16, "width_max": 16,
                     "replays": 0},
            "temperature_c": 35, "memory_temperature_c": None, "power_draw_w": 40.0,
            "power_limit_w": 300.0, "pstate": "P0", "utilization_gpu": 0}


def health_state(correctable: int = 0, **changes) -> dict:
    return seed_state(gpu_health={
        "00000000:17:00.0": q_record("00000000:17:00.0", 0, correctable),
        "00000000:65:00.0": q_record("00000000:65:00.0", 1, 0)}, **changes)


def test_a_healthy_pair_reads_ok_and_an_xid_names_the_gpu():
    assert summarize("gpu-1", health_state(), SETTINGS)["summary"]["health"] == "ok"
    entry = summarize("gpu-1", health_state(xid=XID_79), SETTINGS)
    assert entry["summary"]["health"] == "GPU0 failing (xid_79)"
    assert entry["gpu_health"]["00000000:65:00.0"]["verdict"] == "ok"
    markdown = render_markdown({"generated_at": "t", "hosts": {"gpu-1": entry}})
    assert "### GPU health" in markdown
    row = next(line for line in markdown.splitlines() if line.startswith("| 0 | 00000000:17:00.0"))
    assert "| failing |" in row and "reboot" in row.lower()


def test_correctable_errors_rising_since_the_previous_audit():
    before = summarize("gpu-1", health_state(0), SETTINGS)
    after = summarize("gpu-1", health_state(177), SETTINGS, previous=before)
    gpu0 = after["gpu_health"]["00000000:17:00.0"]
    assert gpu0["verdict"] == "degraded"
    assert "ecc_correctable_rising" in [r["code"] for r in gpu0["reasons"]]
    found = changes({"generated_at": "t0", "hosts": {"gpu-1": before}},
                    {"generated_at": "t1", "hosts": {"gpu-1": after}})["hosts"]["gpu-1"]
    counter = next(c for c in found if c.get("counter") == "ecc_aggregate_correctable")
    assert (counter["before"], counter["after"]) == (0, 177)
    assert change_words(counter) == [
        "GPU0 00000000:17:00.0 ecc_aggregate_correctable: 0 → 177 (+177)"]
    health = next(c for c in found if c["field"] == "health")
    assert (health["before"], health["after"]) == ("ok", "GPU0 degraded (ecc_correctable_rising)")
    # Without the earlier audit nothing rose: preflight's reading is ok.
    assert summarize("gpu-1", health_state(177), SETTINGS)["summary"]["health"] == "ok"
