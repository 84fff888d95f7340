"""The README's settings reference is the one pyinfra_vllm/settings.py generates."""

from __future__ import annotations

from pathlib import Path

from pyinfra_vllm.settings import Settings, reference_markdown


def test_settings_table_matches_the_model():
    readme = Path("README.md").read_text()
    start = readme.index("<!-- settings:start -->\n") + len("<!-- settings:start -->\n")
    end = readme.index("<!-- settings:end -->")
    assert readme[start:end].strip() == reference_markdown().strip(), (
        "README settings table is stale: run `python -m pyinfra_vllm.settings` and paste it"
    )


def test_every_setting_is_in_the_readme():
    readme = Path("README.md").read_text()
    for name in Settings.model_fields:
        assert f"| `{name}` |" in readme
