"""docs/settings.md's table of every setting, generated from the settings model.

Each row is a field of pyinfra_vllm.core.settings.Settings: its name, its default, what
it allows (its choices or bounds) and its meaning (its attribute docstring). This module
reads pydantic's field records only; ``pyinfra_vllm.core.settings.reference_markdown``
passes it the model, and ``python -m pyinfra_vllm.core.settings`` prints the table. The
model's sections share SettingsSection, whose configuration keeps each field's docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict
from pydantic.fields import FieldInfo


class SettingsSection(BaseModel):
    """A section of the settings: pyinfra_vllm.core.settings.Settings is made of them."""

    # Attribute docstrings become field descriptions: docs/settings.md's settings table
    # is generated from them (tests/unit/test_docs.py keeps the two in step).
    model_config = ConfigDict(extra="ignore", frozen=True, use_attribute_docstrings=True)


def field_allowed(field: FieldInfo) -> str | None:
    """What a field allows, in words, from its annotation and constraints: its choices
    (a Literal) or its bounds (gt, ge, lt, le); None when it has neither."""
    choices = [arg for arg in get_args(field.annotation) if arg is not type(None)]
    if choices and get_origin(choices[0]) is Literal:
        choices = list(get_args(choices[0]))
    if get_origin(field.annotation) is Literal or (
        choices and all(not isinstance(choice, type) for choice in choices)
    ):
        return "allowed: " + ", ".join(str(choice) for choice in choices)
    bounds = []
    for meta in field.metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if getattr(meta, attr, None) is not None:
                bounds.append(f"{sign} {getattr(meta, attr)}")
    if bounds:
        return "allowed: " + " and ".join(bounds)
    return None


def default_words(field: FieldInfo, secret: bool) -> str:
    """A field's default as the table shows it; a secret's value never."""
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "none"
    if secret:
        return "none" if not value else "<secret>"
    return f"`{value!r}`" if not isinstance(value, str) else f'`"{value}"`'


def reference_table(fields: Mapping[str, FieldInfo], allowed: Callable[[str], str | None],
                    secret_keys: Collection[str]) -> str:
    """The settings table: every key, its default, what it allows, its meaning.
    ``allowed`` says what a key allows (the settings' own words, as their errors say)."""
    rows = ["| key | default | allowed | meaning |", "|---|---|---|---|"]
    for name, field in fields.items():
        meaning = " ".join((field.description or "").split()).replace("|", "\\|")
        hint = (allowed(name) or "").removeprefix("allowed: ").replace("|", "\\|")
        default = default_words(field, name in secret_keys)
        rows.append(f"| `{name}` | {default} | {hint} | {meaning} |")
    return "\n".join(rows)
