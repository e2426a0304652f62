"""``load_before_forward``: every layer is checked and copied in ``start_load_kv``, before the forward,
so a failure can only surface there — never inside the forward, where TensorRT-LLM 1.1/1.2 would fail
the whole batch and keep its blocks reusable (connector/README.md, "TensorRT-LLM 1.1/1.2").
The default elsewhere (streaming layer by layer) is covered by test_two_engines / test_failure_injection."""

from __future__ import annotations

import pytest
import torch

from connector import _trtllm
from connector.harness import ConnectorWorkerError, ExecutorStopped
from connector.settings import load_connector_settings
from tests.connector.conftest import MODEL, Fleet, _shared_model, doc_tokens
from tests.connector.test_failure_injection import PROMPT, assert_failed_closed, fail_copy_at, setup
from tests.connector.test_two_engines import native_engine

TPB = MODEL.tokens_per_block


def test_the_default_follows_the_engine() -> None:
    """None (the default) means: before the forward only on TensorRT-LLM without cancel_load /
    request_reset; the harness (TensorRT-LLM absent) and engines that recompute stream by layer."""
    assert load_connector_settings({}, environ={}).load_before_forward is None
    assert _trtllm.TRTLLM_WITHOUT_RECOMPUTE == (
        _trtllm.TRTLLM_AVAILABLE and not _trtllm.ENGINE_RECOMPUTES_FAILED_LOADS)
    if not _trtllm.TRTLLM_AVAILABLE:
        assert not _trtllm.TRTLLM_WITHOUT_RECOMPUTE


def test_every_layer_is_loaded_before_the_forward_and_bit_identical(fleet: Fleet) -> None:
    a, b = fleet.engine("A"), fleet.engine("B", load_before_forward=True)
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
    cold = _shared_model(MODEL).forward_dense(doc + question)
    assert torch.allclose(got.prefill_logits, cold[got.prefill_start:], rtol=1e-4, atol=1e-4)
    b.scheduler.flush()
    assert fleet.held_leases() == 0


def test_a_copy_failing_at_layer_k_fails_in_start_load_kv_before_any_layer_runs(fleet: Fleet) -> None:
    b, reads = setup(fleet, load_before_forward=True)
    fail_copy_at(b, 1)
    with pytest.raises(ConnectorWorkerError) as exc:
        b.generate(PROMPT)
    assert exc.value.hook == "start_load_kv"  # not inside the forward
    assert not [layer for event, layer in reads if event == "attention_read"]
    assert_failed_closed(fleet, b, reads, exc, "copy_error", first_unread_layer=0)


def test_on_trtllm_1x_a_failure_inside_the_forward_would_leave_wrong_blocks_for_reuse(fleet: Fleet) -> None:
    """Why ``load_before_forward`` is the default there: the harness handling hook errors as
    TensorRT-LLM 1.1/1.2 does, a copy failing inside the forward (streaming load) fails the request
    and stores its blocks for reuse; the same prompt then reuses them natively and is computed on
    KV nobody finished loading."""
    b, _ = setup(fleet, load_before_forward=False, trtllm_hook_errors=True)
    fail_copy_at(b, 1)
    with pytest.raises(ConnectorWorkerError) as exc:
        b.generate(PROMPT)
    assert exc.value.hook == "wait_for_layer_load"
    again = b.generate(PROMPT)
    assert again.num_reused_tokens > 0 and again.num_connector_tokens == 0  # TensorRT-LLM's own reuse
    cold = _shared_model(MODEL).forward_dense(PROMPT)
    assert not torch.allclose(again.prefill_logits, cold[again.prefill_start:], rtol=1e-4, atol=1e-4)


def test_on_trtllm_1x_loading_before_the_forward_stops_the_executor_and_keeps_nothing(fleet: Fleet) -> None:
    """The same failure with ``load_before_forward`` (the default there): raised by
    ``start_load_kv``, the executor stops — no layer was computed on, no block stored for reuse;
    the restarted engine serves the prompt right."""
    b, reads = setup(fleet, load_before_forward=True, trtllm_hook_errors=True)
    fail_copy_at(b, 1)
    with pytest.raises(ConnectorWorkerError) as exc:
        b.generate(PROMPT)
    assert exc.value.hook == "start_load_kv" and not reads
    with pytest.raises(ExecutorStopped):
        b.generate(PROMPT)
    assert b.metrics.value("semkv_exact_materialized_total") == 0
    b.scheduler.flush()
    assert fleet.held_leases() == 0
    restarted = fleet.restart("B", load_before_forward=True, trtllm_hook_errors=True)
    got = restarted.generate(PROMPT)
    cold = _shared_model(MODEL).forward_dense(PROMPT)
    assert torch.allclose(got.prefill_logits, cold[got.prefill_start:], rtol=1e-4, atol=1e-4)
