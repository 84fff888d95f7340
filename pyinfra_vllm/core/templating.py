"""The suite's configuration templates (templates/), rendered strictly: an undefined
variable is an error, never an empty string in a config file."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from jinja2 import Environment, StrictUndefined

TEMPLATES = Path(__file__).resolve().parents[2] / "templates"


@cache
def _environment() -> Environment:
    # No loader: templates are read with pathlib below (none includes another), which
    # also works while pyinfra-testing patches os.path for an operation's test.
    return Environment(
        undefined=StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(template: str, **values: Any) -> str:
    """``templates/<template>`` rendered with ``values``."""
    text = (TEMPLATES / template).read_text(encoding="utf-8")
    return _environment().from_string(text).render(**values)
