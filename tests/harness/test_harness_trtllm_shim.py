"""Tests of ``connector._trtllm``: the import shim and its local connector ABCs."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from connector import _trtllm
from connector._trtllm import (
    TRTLLM_AVAILABLE,
    KvCacheConnectorScheduler,
    KvCacheConnectorWorker,
    RequestData,
    SchedulerOutput,
)

local_only = pytest.mark.skipif(TRTLLM_AVAILABLE, reason="TensorRT-LLM is installed: real classes")


def test_availability_flag_and_module_name_agree() -> None:
    assert TRTLLM_AVAILABLE == (_trtllm.TRTLLM_CONNECTOR_MODULE is not None)
    if not TRTLLM_AVAILABLE:
        assert "tensorrt_llm" in _trtllm.TRTLLM_IMPORT_ERROR


def test_importing_the_shim_imports_no_torch() -> None:
    code = "import sys, connector._trtllm; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(TRTLLM_AVAILABLE)


@local_only
def test_request_data_has_the_12_and_newer_fields_in_order() -> None:
    names = [f.name for f in dataclasses.fields(RequestData)]
    assert names == ["request_id", "new_tokens", "new_block_ids", "computed_position",
                     "num_scheduled_tokens", "block_hashes", "priorities", "cache_salt",
                     "new_block_ids_by_layer_group"]
    data = RequestData(1, [5], [7], 0, 1)
    assert (data.block_hashes, data.priorities, data.cache_salt) == ([], None, None)
    output = SchedulerOutput()
    assert (output.new_requests, output.cached_requests, output.attention_dp_rank) == ([], [], None)
    assert KvCacheConnectorScheduler.__name__ == "KvCacheConnectorScheduler"


@local_only
def test_abstract_hooks_must_be_implemented() -> None:
    with pytest.raises(TypeError):
        KvCacheConnectorScheduler(None)
    with pytest.raises(TypeError):
        KvCacheConnectorWorker(None)


@local_only
def test_provided_methods_and_layer_group_folding() -> None:
    class Scheduler(KvCacheConnectorScheduler):
        def build_connector_meta(self, scheduler_output):
            return {}

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 0, False

        def update_state_after_alloc(self, request, block_ids):
            self.seen = block_ids

        def request_finished(self, request, cache_block_ids):
            return bool(cache_block_ids)

    class Worker(KvCacheConnectorWorker):
        def register_kv_caches(self, kv_cache_tensor):
            pass

        def start_load_kv(self, stream):
            pass

        def wait_for_layer_load(self, layer_idx, stream):
            pass

        def save_kv_layer(self, layer_idx, stream):
            pass

        def wait_for_save(self, stream):
            pass

        def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
            return [], []

    scheduler, worker = Scheduler("args"), Worker("args")
    assert scheduler.supports_attention_dp is False and scheduler._llm_args == "args"
    scheduler.update_state_after_alloc_by_layer_group(None, [[3, 4]])
    assert scheduler.seen == [3, 4]
    assert scheduler.request_finished_by_layer_group(None, [[1]]) is True
    with pytest.raises(NotImplementedError):
        scheduler.request_finished_by_layer_group(None, [[1], [2]])
    assert scheduler.wait_for_initialization() is None
    worker.bind_connector_meta({"x": 1})
    assert worker.get_connector_meta() == {"x": 1}
    assert worker.register_forward_pass_callable() is None


@pytest.mark.trtllm
@pytest.mark.skipif(not TRTLLM_AVAILABLE, reason="TensorRT-LLM is not installed here")
def test_real_classes_are_reexported_when_tensorrt_llm_is_installed() -> None:
    assert KvCacheConnectorScheduler.__module__ == _trtllm.TRTLLM_CONNECTOR_MODULE
    assert RequestData.__module__ == _trtllm.TRTLLM_CONNECTOR_MODULE
