"""pyinfra_vllm.plans.compat: the architecture gate (the driver minimum is pyinfra_vllm.plans.checks's)."""

from __future__ import annotations

import json
from pathlib import Path

from facts.versions import version_tuple
from pyinfra_vllm.core.stacks import STACKS
from pyinfra_vllm.plans.compat import check_architecture, first_supporting

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures/hf/qwen3.6-27b/config.json"


def qwen36() -> dict:
    return json.loads(FIXTURE.read_text())


def test_qwen36_on_063_is_refused_naming_the_first_release():
    arch = check_architecture(qwen36(), STACKS["0.6.3"], None, model_id="Qwen/Qwen3.6-27B")
    assert arch["ok"] is False and arch["severity"] == "error"
    assert arch["detail"] == (
        "vLLM 0.6.3 cannot load Qwen3_5ForConditionalGeneration (Qwen/Qwen3.6-27B); it is "
        "supported from vLLM 0.17.0")
    assert arch["fix"] == "set vllm_version to 0.17.0 or later (rows: 0.6.3, 0.17.0, 0.22.0, 0.33.0)"


def test_qwen36_on_017_passes():
    assert check_architecture(qwen36(), STACKS["0.17.0"], None)["ok"] is True


def test_installed_registry_wins_over_the_table():
    arch = check_architecture(qwen36(), STACKS["0.17.0"], ["Qwen2ForCausalLM"])
    assert arch["ok"] is False and "0.17.0" in arch["detail"]
    tiny = {"architectures": ["Qwen2ForCausalLM"]}
    assert check_architecture(tiny, STACKS["0.6.3"], ["Qwen2ForCausalLM", "X"])["ok"]


def test_unknown_architecture_is_not_judged_without_a_registry():
    arch = check_architecture({"architectures": ["LlamaForCausalLM"]}, STACKS["0.6.3"], None)
    assert arch["ok"] is None and arch["severity"] == "warning"


def test_missing_architectures():
    assert check_architecture({}, STACKS["0.6.3"], None)["ok"] is False


def test_qwen3_on_063_names_084_and_versions_compare_numerically():
    arch = check_architecture({"architectures": ["Qwen3ForCausalLM"]}, STACKS["0.6.3"], None)
    assert "supported from vLLM 0.8.4" in arch["detail"]
    assert first_supporting("Qwen3NextForCausalLM") == "0.10.2"
    assert version_tuple("0.10.2") > version_tuple("0.8.4") > version_tuple("0.6.3.post1")
    assert version_tuple("570.124.06") > version_tuple("570.26")


def test_first_supporting_falls_back_to_the_oldest_stack_row_listing_it():
    # Not in FIRST_SUPPORTED; listed by the 0.6.3 and 0.17.0 rows.
    assert first_supporting("Qwen2ForRewardModel") == "0.6.3"
    assert first_supporting("NoSuchArchitecture") is None
