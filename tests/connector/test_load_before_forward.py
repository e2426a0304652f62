"""On TensorRT-LLM every layer is checked and copied in ``start_load_kv``, before the forward: a
check that fails can then only fail there (the executor stops before attention reads anything),
never inside the forward, where TensorRT-LLM fails the whole batch and stores the batch's blocks for
reuse (connector/README.md, "What a promise means"). vLLM loads layer by layer
(test_failure_injection.py)."""

from __future__ import annotations

import pytest
import torch

from connector.engine_contract import VLLM
from connector.harness import ConnectorWorkerError
from connector.worker import SemKvWorker
from tools.harness.fleet import MODEL, Fleet, shared_model, doc_tokens
from tests.connector.test_failure_injection import PROMPT, fail_copy_at, setup
from tests.connector.test_two_engines import native_engine

TPB = MODEL.tokens_per_block


def test_every_layer_is_loaded_before_the_forward_and_bit_identical(fleet: Fleet) -> None:
    a, b = fleet.engine("A"), fleet.engine("B", load_before_forward=False)  # the setting is vLLM's only
    assert b.worker.load_before_forward
    doc, question = doc_tokens(15 * TPB), doc_tokens(40, seed=2)
    a.generate(doc)
    fleet.sync()
    order: list[tuple[str, int]] = []
    b.llm.add_forward_observer(lambda event, layer, ids: order.append((event, layer)))
    copy_layer = b.worker._copy_layer

    def recording(load, layer_idx):  # noqa: ANN001, ANN202
        order.append(("copy", layer_idx))
        copy_layer(load, layer_idx)

    b.worker._copy_layer = recording  # type: ignore[method-assign]
    got = b.generate(doc + question)
    assert got.num_connector_tokens == len(doc)
    copies = [i for i, (event, _) in enumerate(order) if event == "copy"]
    assert [order[i][1] for i in copies] == list(range(MODEL.num_layers))
    assert copies[-1] < order.index(("wait_for_layer_load_returned", 0))  # all before the forward began
    assert b.metrics.value("semkv_exact_materialized_total") == 1
    native = native_engine()
    native.generate(doc, 1)
    reference = native.generate(doc + question, 1)
    assert torch.equal(got.prefill_logits, reference.prefill_logits)
    cold = shared_model(MODEL).forward_dense(doc + question)
    assert torch.allclose(got.prefill_logits, cold[got.prefill_start:], rtol=1e-4, atol=1e-4)
    b.scheduler.flush()
    assert fleet.held_leases() == 0


def test_why_a_failure_inside_tensorrt_llms_forward_must_not_happen(fleet: Fleet) -> None:
    """A worker that loaded layer by layer (vLLM's way) on TensorRT-LLM, failing a copy at layer 1:
    the forward fails the request, TensorRT-LLM stores its blocks for reuse as they are, and the
    same prompt then reuses them through TensorRT-LLM's own prefix cache and is computed on KV
    nobody finished loading. Hence: on TensorRT-LLM, nothing that can fail runs inside the forward."""
    b, _ = setup(fleet)
    streaming = SemKvWorker(b.llm.llm_args, settings=b.settings, metrics=b.metrics, engine=VLLM)
    streaming.register_kv_caches(b.llm.kv_cache)
    binding, b.llm.connector.workers[0] = b.llm.connector.workers[0], streaming  # the fleet closes the new one
    try:
        fail_copy_at(streaming, 1)
        with pytest.raises(ConnectorWorkerError) as exc:
            b.llm.generate(PROMPT)
        assert exc.value.hook == "wait_for_layer_load" and b.llm.stopped is None
        again = b.llm.generate(PROMPT)
        assert again.num_reused_tokens > 0 and again.num_connector_tokens == 0  # TensorRT-LLM's own reuse
        cold = shared_model(MODEL).forward_dense(PROMPT)
        assert not torch.allclose(again.prefill_logits, cold[again.prefill_start:], rtol=1e-4, atol=1e-4)
    finally:
        binding.close()
