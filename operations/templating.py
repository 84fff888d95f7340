"""The suite's configuration templates (templates/), rendered strictly: an undefined
variable is an error, never an empty string in a config file."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"


@cache
def _environment() -> Environment:
    return Environment(
        loader=FileSystemLoader(str(TEMPLATES)),
        undefined=StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(template: str, **values: Any) -> str:
    """``templates/<template>`` rendered with ``values``."""
    return _environment().get_template(template).render(**values)
