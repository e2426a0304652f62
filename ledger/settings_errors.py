"""One-line operator messages for pydantic-settings' own errors (the consumer's and the connector's
settings both load through pydantic-settings).

pydantic-settings reads a list or table setting from an environment variable as JSON and, when that
fails, raises ``SettingsError('error parsing value for field "sources" from source
"EnvSettingsSource"')`` with the JSON error as its cause: neither the variable nor "JSON" is named
(pydantic/pydantic-settings, ``pydantic_settings/sources/base.py``, ``PydanticBaseEnvSettingsSource``).
"""

from __future__ import annotations

import re

__all__ = ["explain_settings_error"]

_FIELD = re.compile(r'field "([^"]+)" from source "(\w+)"')


def explain_settings_error(exc: BaseException, env_prefix: str) -> str:
    """``exc`` (a ``pydantic_settings.SettingsError``) as one line naming the setting and, for one
    read from the environment, its variable (``env_prefix`` + the field's name in capitals) and that
    its value must be JSON, with the JSON error. Other errors: ``str(exc)``."""
    match = _FIELD.search(str(exc))
    if match is None:
        return str(exc)
    field, source = match.groups()
    cause = f": {exc.__cause__}" if exc.__cause__ is not None else ""
    if source == "EnvSettingsSource":
        return (f"{env_prefix}{field.upper()} is not valid JSON{cause} (a list or table setting given in the "
                "environment is JSON)")
    return f"setting '{field}' (from {source}) could not be parsed{cause}"
