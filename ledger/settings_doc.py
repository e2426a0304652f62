"""Markdown tables of pydantic settings models, for the generated settings pages under ``docs/``.

Each field's documentation is its attribute docstring (``use_attribute_docstrings=True`` on the
model), so the page and the code cannot drift apart; a field without one is an error here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["default_text", "markdown_cell", "model_rows"]


def default_text(field: Any) -> str:
    """A field's default as a Markdown cell: ``unset`` for None, the factory's value for factories."""
    if field.default_factory is not None:
        return f"`{field.default_factory()!r}`"
    if field.is_required():
        return "required"
    value = field.default
    if value is None:
        return "unset"
    return '`""`' if value == "" else f"`{value}`"


def markdown_cell(text: str | None) -> str:
    """One table cell from a docstring.

    Raises:
        ValueError: the field has no docstring (it is its documentation).
    """
    if not text:
        raise ValueError("every setting needs a docstring (it is its documentation)")
    return " ".join(text.split()).replace("|", "\\|")


def model_rows(model: type, *, env_prefix: str, key_prefix: str = "", skip: frozenset[str] = frozenset()) -> list[str]:
    """``| key | environment variable | default | meaning |`` rows, one per field of ``model``.

    ``key_prefix`` names a nested table (``namespace.``); its variables use ``__`` between levels,
    as pydantic-settings' ``env_nested_delimiter`` does.
    """
    env_stem = env_prefix + key_prefix.replace(".", "__").upper()
    rows = []
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        try:
            meaning = markdown_cell(field.description)
        except ValueError as exc:
            raise ValueError(f"{model.__name__}.{name}: {exc}") from None
        rows.append(f"| `{key_prefix}{name}` | `{env_stem}{name.upper()}` | {default_text(field)} | {meaning} |")
    return rows
