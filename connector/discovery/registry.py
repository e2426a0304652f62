"""Providers by name or import path (``[discovery] providers`` in the connector's settings).

``exact``, ``chunks``, ``minhash`` and ``embedding`` name the built-ins; anything else is an import
path ``package.module:Class`` (or ``package.module.Class``) of a class constructed as
``Class(settings, db=ledger_url)`` that implements :class:`~connector.discovery.types.DiscoveryProvider`.
"""

from __future__ import annotations

import importlib
from typing import Any

from connector.discovery.settings import DiscoverySettings
from connector.discovery.types import DiscoveryProvider
from connector.settings import ConnectorConfigError

__all__ = ["BUILTIN_PROVIDERS", "build_providers", "resolve_provider"]

BUILTIN_PROVIDERS = {
    "exact": "connector.discovery.exact:LedgerPrefixProvider",
    "chunks": "connector.discovery.chunks:BlockChunkProvider",
    "minhash": "connector.discovery.minhash:MinHashProvider",
    "embedding": "connector.discovery.embedding:EmbeddingProvider",
}
_REQUIRED = ("name", "generation", "needs_text", "index", "forget", "candidates", "prepare", "flush", "close")


def resolve_provider(spec: str) -> type:
    """The provider class for an alias or import path.

    Raises:
        ConnectorConfigError: unknown module or attribute, or not a provider class.
    """
    path = BUILTIN_PROVIDERS.get(spec, spec)
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConnectorConfigError(f"discovery provider {spec!r}: expected an alias "
                                   f"({', '.join(BUILTIN_PROVIDERS)}) or 'package.module:Class'")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConnectorConfigError(f"discovery provider {spec!r}: {exc}") from None
    missing = [name for name in _REQUIRED if not hasattr(cls, name)]
    if missing:
        raise ConnectorConfigError(f"discovery provider {spec!r} lacks {', '.join(missing)}")
    return cls


def build_providers(settings: DiscoverySettings, *, db: str | None,
                    instances: dict[str, Any] | None = None) -> list[DiscoveryProvider]:
    """Construct every provider of ``settings.providers`` in order.

    Args:
        instances: already built providers by spec (tests, or a model shared between services).

    Raises:
        ConnectorConfigError: a provider cannot be resolved or constructed, or two share a name.
    """
    out: list[DiscoveryProvider] = []
    for spec in settings.providers:
        provider = (instances or {}).get(spec)
        if provider is None:
            try:
                provider = resolve_provider(spec)(settings, db=db)
            except (TypeError, ValueError) as exc:
                raise ConnectorConfigError(f"discovery provider {spec!r} could not start: {exc}") from None
        if any(p.name == provider.name for p in out):
            raise ConnectorConfigError(f"two discovery providers are named {provider.name!r}")
        out.append(provider)
    return out
