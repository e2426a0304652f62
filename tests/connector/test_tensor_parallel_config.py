"""Tensor parallelism without processes: the namespace's ``parallel_layout`` and per-rank pool layout
(connector/namespace.py, connector/layouts.py), ``connector-check --llm-args``, and the donor store's
shards and manifest (connector/donor_store.py). The two-process end-to-end tests are in
test_tensor_parallel.py."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from connector import donor_store
from connector.donor_store import EntryMissing, FileDonorStore, SecuredShards, shard_ref
from connector.harness import HarnessLlmArgs, KvCacheConfig, LlmRequest, ModelConfig
from connector.layouts import parallel_layouts, refused
from connector.namespace import DeploymentNamespace, Namespace, NamespaceUnknown
from connector.vllm_connector import VllmDeployment

CFG = ModelConfig(num_heads=8, num_kv_heads=4)
ARGS = HarnessLlmArgs(model=CFG.name, harness_model_config=CFG, kv_cache_config=KvCacheConfig(), max_seq_len=4096,
                      max_num_tokens=512)


def namespace(args: HarnessLlmArgs) -> tuple[DeploymentNamespace, Namespace | NamespaceUnknown]:
    deployment = DeploymentNamespace(args, engine_id="e", attention_dp_api=True)
    return deployment, deployment.for_request(LlmRequest(1, [1], 1))


def test_tp_is_in_the_namespace_with_the_kv_heads_of_each_rank_and_one_ranks_pool() -> None:
    (single, ns1), (tp2, ns2), (tp4, ns4) = (namespace(dataclasses.replace(ARGS, tensor_parallel_size=n))
                                             for n in (1, 2, 4))
    assert "parallel_layout" not in ns1.fields  # TP = 1 keeps its digest
    assert ns2.fields["parallel_layout"] == "tp=2,kv_heads=0-1/2-3"
    assert ns4.fields["parallel_layout"] == "tp=4,kv_heads=0-0/1-1/2-2/3-3"
    assert len({ns1.digest, ns2.digest, ns4.digest}) == 3  # shards of different layouts never mix
    assert (single.tp_size, tp2.tp_size, tp4.tp_size) == (1, 2, 4)
    assert single.layout.block_elems == 2 * tp2.layout.block_elems == 4 * tp4.layout.block_elems


def test_kv_heads_that_cannot_be_split_evenly_are_refused() -> None:
    args = dataclasses.replace(ARGS, tensor_parallel_size=8)  # 4 KV heads: TensorRT-LLM would replicate them
    _, ns = namespace(args)
    assert isinstance(ns, NamespaceUnknown) and (ns.field, ns.kind) == ("parallel_layout", "unsupported")
    assert "4 KV heads over tensor_parallel_size=8" in ns.detail
    row = refused(parallel_layouts(args, attention_dp_api=True, num_kv_heads=4))
    assert row is not None and row.layout == "tensor_parallel" and "replicates" in row.reason


def test_attention_dp_ranks_hold_every_head_and_are_not_a_tp_split() -> None:
    deployment, ns = namespace(dataclasses.replace(ARGS, tensor_parallel_size=2, enable_attention_dp=True))
    assert deployment.tp_size == 1 and ns.fields["parallel_layout"].startswith("attention_dp=2")


def test_the_vllm_adapter_keeps_tp_refused() -> None:
    args = types.SimpleNamespace(tensor_parallel_size=2,
                                 semkv_tensor_parallel_refused=VllmDeployment.semkv_tensor_parallel_refused)
    row = refused(parallel_layouts(args, attention_dp_api=True))
    assert row is not None and row.layout == "tensor_parallel" and "vLLM adapter" in row.reason


def test_connector_check_reports_tp_supported_with_the_heads_of_each_rank(check, tmp_path: Path) -> None:
    result = check("tensor_parallel_size: 2\n")
    assert result.exit_code == 0, result.output
    # without the model, the KV heads are not known: said, not taken as a pass
    assert ("tensor parallelism (TP): supported (tensor_parallel_size=2, if the model's KV heads are a multiple of "
            "the ranks: not checked without them): every rank holds") in result.output
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 32, "num_key_value_heads": 8}))
    result = check("tensor_parallel_size: 4\n", "--model", str(model))
    assert result.exit_code == 0, result.output
    assert "supported (tensor_parallel_size=4, KV heads by rank 0-1/2-3/4-5/6-7)" in result.output
    result = check("tensor_parallel_size: 16\n", "--model", str(model))
    assert result.exit_code == 1, result.output
    assert "tensor parallelism (TP): REFUSED (tensor_parallel_size=16, 8 KV heads)" in result.output


# ----------------------------------------------------------------------------------- store: shards
LAYERS, BLOCKS, ELEMS = 2, 3, 8


def shard_layers(rank: int) -> list[np.ndarray]:
    rng = np.random.default_rng(rank)
    return [rng.standard_normal((BLOCKS, 2, ELEMS), dtype=np.float32) for _ in range(LAYERS)]


def header(num_blocks: int = BLOCKS) -> dict:
    return {"namespace": "ns", "num_layers": LAYERS, "kv_factor": 2, "block_elems": ELEMS, "dtype": "float32",
            "itemsize": 4, "num_blocks": num_blocks, "tokens_per_block": 8, "probe": "p"}


def test_the_last_shard_published_completes_the_donor_with_a_manifest(tmp_path: Path) -> None:
    store = FileDonorStore(tmp_path, 2**20)
    shard1, manifest = store.put_shard("d", 1, 2, shard_layers(1), header())
    assert shard1.ref == shard_ref("d", 1, 2) == "d.tp1of2.kv" and manifest is None  # rank 0's shard missing
    assert not (tmp_path / "d.kv").exists()
    shard0, manifest = store.put_shard("d", 0, 2, shard_layers(0), header())
    assert manifest is not None and manifest.ref == "d.kv"
    assert manifest.size_bytes == shard0.size_bytes + shard1.size_bytes + os.path.getsize(tmp_path / "d.kv")
    with store.open(manifest.ref, manifest.checksum) as reader:  # the ledger's checksum covers the shard list
        assert reader.header.shards == ((shard0.ref, shard0.checksum), (shard1.ref, shard1.checksum))
    with store.open(shard1.ref, shard1.checksum) as reader:
        assert reader.header.shard == (1, 2) and reader.header.donor_id == "d"
    # publishing a shard again never makes a second manifest (exactly one donor_saved)
    assert store.put_shard("d", 1, 2, shard_layers(1), header())[1] is None
    assert store.entries() == [("d", store.size_of("d.kv"), store.entries()[0][2])]  # one donor, every file
    assert store.donors_with_probe("p") == ["d"]
    assert store.evict("d", "test") and sorted(os.listdir(tmp_path)) == ["probe"]


def test_shards_that_disagree_never_complete_a_donor(tmp_path: Path) -> None:
    store = FileDonorStore(tmp_path, 2**20)
    store.put_shard("d", 0, 2, shard_layers(0), header())
    other = shard_layers(1)[:1] + [np.zeros((BLOCKS - 1, 2, ELEMS), np.float32)]
    with pytest.raises(ValueError):
        store.put_shard("d", 1, 2, other, header())  # its layers do not match its own header
    assert store.put_shard("d", 1, 2, [a[:2] for a in shard_layers(1)], header(num_blocks=2))[1] is None
    assert not (tmp_path / "d.kv").exists()


def test_a_manifest_is_verified_trusted_and_secured_only_with_every_shard(tmp_path: Path, monkeypatch) -> None:
    writer = FileDonorStore(tmp_path, 2**20)
    writer.put_shard("d", 0, 2, shard_layers(0), header())
    _, manifest = writer.put_shard("d", 1, 2, shard_layers(1), header())
    monkeypatch.setattr(donor_store, "_VERIFIED", {})  # another process (a scheduler): verified nothing
    store = FileDonorStore(tmp_path, 2**20)
    assert store.verified(manifest.ref, manifest.checksum) is None and store.shards_of(manifest.ref) == ()
    assert store.size_of(manifest.ref) == manifest.size_bytes  # what an inline verify would read
    store.verify(manifest.ref, manifest.checksum)  # every shard, in full
    assert [ref for ref, _ in store.shards_of(manifest.ref)] == ["d.tp0of2.kv", "d.tp1of2.kv"]
    assert store.verified(manifest.ref, manifest.checksum) and store.known_verified(manifest.ref, manifest.checksum)
    secured = store.secure(manifest.ref, manifest.checksum)
    assert isinstance(secured, SecuredShards) and secured.shard(1).reader().header.shard == (1, 2)
    secured.release()
    os.unlink(tmp_path / "d.tp1of2.kv")  # one shard gone: the whole donor is not to be trusted
    assert store.recheck_verified() == 1
    assert not store.known_verified(manifest.ref, manifest.checksum)
    assert store.secure(manifest.ref, manifest.checksum) is None
    with pytest.raises(EntryMissing):
        store.verified(manifest.ref, manifest.checksum)


_OPEN_HANDLE = """
import sys
from connector.donor_store import FileDonorStore
root, path, dev, ino, ref, checksum = sys.argv[1:]
with FileDonorStore(root, 2**20).open_handle((path, int(dev), int(ino)), ref, checksum) as reader:
    print(reader.header.shard, bytes(reader.read_layer(0)).hex())
"""


def _open_handle_elsewhere(root: Path, handle: tuple[str, int, int], ref: str, checksum: str) -> str:
    """Another process of this host opens ``handle`` (as rank 1's worker does); its stdout, or its error."""
    out = subprocess.run([sys.executable, "-c", _OPEN_HANDLE, str(root), *map(str, handle), ref, checksum],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    return out.stdout.strip() if out.returncode == 0 else out.stderr.strip().splitlines()[-1]


def test_another_process_reads_a_secured_shard_through_its_handle_after_eviction_or_replacement(
        tmp_path: Path) -> None:
    store = FileDonorStore(tmp_path, 2**20)
    store.put_shard("d", 0, 2, shard_layers(0), header())
    shard1, manifest = store.put_shard("d", 1, 2, shard_layers(1), header())
    store.verify(manifest.ref, manifest.checksum)
    secured = store.secure(manifest.ref, manifest.checksum)
    assert isinstance(secured, SecuredShards)
    handle = secured.handles()[1]
    expected = f"(1, 2) {shard_layers(1)[0].tobytes().hex()}"
    assert _open_handle_elsewhere(tmp_path, handle, shard1.ref, shard1.checksum) == expected
    assert store.evict("d", "capacity", force=True) and not (tmp_path / shard1.ref).exists()
    # evicted (another process's capacity eviction): the held file is still the checksummed shard
    assert _open_handle_elsewhere(tmp_path, handle, shard1.ref, shard1.checksum) == expected
    # a new donor "d" under the same names: the handle still reads the file that was secured
    store.put_shard("d", 1, 2, shard_layers(7), header())
    assert _open_handle_elsewhere(tmp_path, handle, shard1.ref, shard1.checksum) == expected
    secured.release()
    # let go: the path names nothing, or another file that took the descriptor number (never read)
    assert "EntryMissing" in _open_handle_elsewhere(tmp_path, handle, shard1.ref, shard1.checksum)
    with pytest.raises(EntryMissing):
        secured.handles()


def test_a_handle_that_names_another_file_is_refused(tmp_path: Path) -> None:
    store = FileDonorStore(tmp_path, 2**20)
    shard0, _ = store.put_shard("d", 0, 2, shard_layers(0), header())
    other = tmp_path / "unrelated"
    other.write_bytes(b"x" * 64)
    st = os.stat(tmp_path / shard0.ref)
    with pytest.raises(EntryMissing, match="another file"):
        store.open_handle((str(other), st.st_dev, st.st_ino), shard0.ref, shard0.checksum)
