"""pyinfra_vllm.core.stacks: every row has the fields other code reads, and the table agrees with it."""

from __future__ import annotations

import dataclasses
import re

from facts.versions import version_tuple
from pyinfra_vllm.core.stacks import FIRST_SUPPORTED, REMOVED_FROM, STACKS

KEYS = {"vllm", "python", "torch", "cuda", "min_driver", "pins", "architectures"}


def test_rows_have_every_key_and_consistent_pins():
    for version, row in STACKS.items():
        assert KEYS <= {field.name for field in dataclasses.fields(row)}, version
        assert row.vllm == version
        assert row.pins["torch"] == row.torch
        assert re.fullmatch(r"\d{3}\.\d+(\.\d+)?", row.min_driver)
        assert re.fullmatch(r"3\.1[0-3]", row.python)


def test_first_supported_agrees_with_rows():
    for arch, first in FIRST_SUPPORTED.items():
        gone = REMOVED_FROM.get(arch)
        for version, row in STACKS.items():
            listed = arch in row.architectures
            present = version_tuple(version) >= version_tuple(first) and (
                gone is None or version_tuple(version) < version_tuple(gone))
            assert listed == present, (arch, version)


def test_the_qwen36_stack():
    row = STACKS["0.17.0"]
    assert "Qwen3_5ForConditionalGeneration" in row.architectures
    assert row.cuda == "12.8" and row.torch == "2.10.0"
    assert row.pins["transformers"].startswith("4.")  # vLLM 0.17: transformers<5
    assert "Qwen3_5ForConditionalGeneration" not in STACKS["0.6.3"].architectures
