"""Settings (TOML + TRTLLM_SEMKV_* env, errors name the setting) and namespaces / content keys."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys

import pytest

from connector.harness import HarnessLlmArgs, KvCacheConfig, LlmRequest, ModelConfig
from connector.namespace import DeploymentNamespace, NamespaceUnknown, content_keys, prefix_keys, probe_key, salt_id, without_multimodal
from connector.plan import ConnectorMetadata, LoadPlan, SaveInstruction
from connector.settings import ConnectorConfigError, NamespaceOverrides, kv_layout_dims, load_connector_settings

CFG = ModelConfig()
ARGS = HarnessLlmArgs(model=CFG.name, harness_model_config=CFG, kv_cache_config=KvCacheConfig(), max_seq_len=4096,
                      max_num_tokens=512)


def test_settings_from_toml_file_named_by_trtllm_env_and_env_overrides(tmp_path, monkeypatch) -> None:
    config = tmp_path / "semkv.toml"
    config.write_text('mode = "exact_equivalent"\nengine_id = "trt-0"\nlookup_timeout_s = 0.004\n'
                      '[namespace]\nkv_dtype = "bfloat16"\n')
    monkeypatch.setenv("TRTLLM_SEMKV_CONFIG", str(config))
    monkeypatch.setenv("TRTLLM_SEMKV_LEASE_TTL_S", "30")
    s = load_connector_settings()
    assert (s.mode, s.engine_id, s.lookup_timeout_s, s.lease_ttl_s) == ("exact_equivalent", "trt-0", 0.004, 30.0)
    assert s.namespace.kv_dtype == "bfloat16" and s.config == config and s.materializes


def test_safe_defaults() -> None:
    s = load_connector_settings(environ={})
    assert s.mode == "discovery_only" and not s.materializes
    assert s.lookup_timeout_s == 0.002 and s.freshness_policy == "engine"


@pytest.mark.parametrize(("values", "named"), [
    ({"lookup_timeout_s": 0}, "lookup_timeout_s"),
    ({"store_capacity_bytes": -1}, "store_capacity_bytes"),
    ({"freshness_policy": "vibes"}, "freshness_policy"),
    ({"db": "mysql://x/y"}, "db"),
    ({"mode": "experimental"}, "mode"),
    ({"unknown_knob": 1}, "unknown_knob"),
    # Redis URLs redis-py would refuse (a traceback in connector-check before) or read as something else
    ({"redis_url": "127.0.0.1:6379"}, "redis_url"),
    ({"redis_url": "redis://127.0.0.1:notaport/0"}, "redis_url"),
    ({"redis_url": "redis://127.0.0.1:99999/0"}, "redis_url"),
    ({"redis_url": "redis://[::1"}, "redis_url"),
    ({"redis_url": "redis://127.0.0.1:6379/abc"}, "redis_url"),
    ({"redis_url": "redis://"}, "redis_url"),
    ({"redis_url": "unix://"}, "redis_url"),
    ({"profit": {"margin": 0.5}}, "profit.margin"),
])
def test_invalid_settings_fail_at_start_up_naming_the_setting(values, named) -> None:
    with pytest.raises(ConnectorConfigError, match=f"setting '{named}'"):
        load_connector_settings(values, environ={})


def test_missing_config_file_is_an_error(tmp_path) -> None:
    with pytest.raises(ConnectorConfigError, match="TRTLLM_SEMKV_CONFIG"):
        load_connector_settings(environ={"TRTLLM_SEMKV_CONFIG": str(tmp_path / "nope.toml")})


def ns_of(request: LlmRequest, args=ARGS, engine_id: str | None = "engine-a", **overrides):  # noqa: ANN001, ANN202
    return DeploymentNamespace(args, NamespaceOverrides(**overrides), engine_id).for_request(request)


def test_namespace_changes_with_every_kv_relevant_field() -> None:
    base = ns_of(LlmRequest(1, [1, 2, 3], 1))
    variants = [
        ns_of(LlmRequest(1, [1, 2, 3], 1, cache_salt="tenant")),
        ns_of(LlmRequest(1, [1, 2, 3], 1, lora_task_id=4)),
        ns_of(LlmRequest(1, [1, 2, 3], 1), kv_dtype="bfloat16"),
        ns_of(LlmRequest(1, [1, 2, 3], 1), tenant="other"),
        ns_of(LlmRequest(1, [1, 2, 3], 1), engine_version="tensorrt_llm/9.9"),
        ns_of(LlmRequest(1, [1, 2, 3], 1), args=dataclasses.replace(ARGS, model="another-model")),
        ns_of(LlmRequest(1, [1, 2, 3], 1), args=dataclasses.replace(
            ARGS, harness_model_config=ModelConfig(tokens_per_block=16),
            kv_cache_config=KvCacheConfig(tokens_per_block=16))),
    ]
    digests = {base.digest, *(v.digest for v in variants)}
    assert len(digests) == 1 + len(variants)
    mm = LlmRequest(1, [1, 2, 3], 1)
    mm.multimodal_hashes = [[1, 2, 3, 4]]
    assert ns_of(mm).digest != base.digest
    # the reuse guard keys blocks as TensorRT-LLM's tree does: a multimodal request's text blocks are
    # those of the text request of the same scope (and salt and LoRA still tell them apart)
    assert without_multimodal(ns_of(mm)) == base and without_multimodal(base) is base
    salted = LlmRequest(1, [1, 2, 3], 1, cache_salt="tenant")
    salted.multimodal_hashes = [[1, 2, 3, 4]]
    assert without_multimodal(ns_of(salted)) == variants[0] != base
    assert ns_of(LlmRequest(9, [7, 7], 1)).digest == base.digest  # tokens are in the keys, not the namespace


def test_salt_string_and_1_2_salt_id_agree() -> None:
    @dataclasses.dataclass
    class Request12:  # TensorRT-LLM 1.2 exposes only the id
        cache_salt_id: int | None
        lora_task_id: int | None = None

    newer = ns_of(LlmRequest(1, [1], 1, cache_salt="tenant-a"))
    assert ns_of(Request12(salt_id("tenant-a"))).digest == newer.digest


def test_unknown_or_unsupported_fields_give_no_namespace() -> None:
    auto = dataclasses.replace(ARGS, dtype="auto")
    assert ns_of(LlmRequest(1, [1], 1), args=auto) == NamespaceUnknown(
        "kv_dtype", "KV dtype is 'auto' in llm_args; set [namespace] kv_dtype")
    # TensorRT-LLM's short name, as the torch dtype its pool tensor carries (what the worker registers)
    assert ns_of(LlmRequest(1, [1], 1), args=auto, kv_dtype="fp8").fields["kv_dtype"] == "float8_e4m3fn"
    assert ns_of(LlmRequest(1, [1], 1), args=dataclasses.replace(ARGS, dtype="bf16")).fields["kv_dtype"] == "bfloat16"
    pp = dataclasses.replace(ARGS, pipeline_parallel_size=2)
    assert ns_of(LlmRequest(1, [1], 1), args=pp).kind == "unsupported"

    class Bare:  # a request object that does not say whether it has a tenant salt
        lora_task_id = None

    assert ns_of(Bare()).field == "cache_salt"
    ptuning = LlmRequest(1, [1], 1)
    ptuning.prompt_embedding_table = object()
    assert ns_of(ptuning).field == "ptuning"


def test_a_lora_task_id_names_an_adapter_only_inside_its_engine_unless_ids_are_fleet_wide() -> None:
    """TensorRT-LLM's lora_task_id is a number each engine assigns: engine A's task 4 and engine B's
    task 4 may be different adapters, so by default their donors never meet."""
    lora = LlmRequest(1, [1, 2, 3], 1, lora_task_id=4)
    on_a, on_b = ns_of(lora, engine_id="engine-a"), ns_of(lora, engine_id="engine-b")
    assert on_a.digest != on_b.digest and on_a.fields["lora_task_id"] == "task:4@engine:engine-a"
    assert ns_of(lora, engine_id="engine-a").digest == on_a.digest
    unscoped = ns_of(lora, engine_id=None)
    assert isinstance(unscoped, NamespaceUnknown) and unscoped.field == "lora_task_id"
    fleet_a = ns_of(lora, engine_id="engine-a", lora_task_ids="fleet")
    assert fleet_a.digest == ns_of(lora, engine_id="engine-b", lora_task_ids="fleet").digest
    assert fleet_a.digest != ns_of(LlmRequest(1, [1], 1, lora_task_id=5), lora_task_ids="fleet").digest
    negative = ns_of(LlmRequest(1, [1], 1, lora_task_id=-1), engine_id="engine-a")  # scoped by kind, not shape
    assert negative.fields["lora_task_id"] == "task:-1@engine:engine-a"
    # no LoRA: the engine does not enter the namespace (donors are shared fleet-wide)
    plain = LlmRequest(1, [1, 2, 3], 1)
    assert ns_of(plain, engine_id="engine-a").digest == ns_of(plain, engine_id="engine-b").digest


def test_content_keys_are_chained_over_namespace_and_every_earlier_token() -> None:
    ns, other = ns_of(LlmRequest(1, [1], 1)), ns_of(LlmRequest(1, [1], 1, cache_salt="t"))
    tokens = list(range(100, 100 + 4 * 32))
    keys = content_keys(ns, tokens, 32)
    assert len(keys) == 4 and all(len(k) == 16 for k in keys) and len(set(keys)) == 4
    changed = list(tokens)
    changed[5] += 1  # a token of block 0 changes every later key
    assert all(a != b for a, b in zip(keys, content_keys(ns, changed, 32)))
    late = list(tokens)
    late[3 * 32 + 1] += 1
    assert content_keys(ns, late, 32)[:3] == keys[:3] and content_keys(ns, late, 32)[3] != keys[3]
    assert all(a != b for a, b in zip(keys, content_keys(other, tokens, 32)))  # the salt is in every key
    assert content_keys(ns, tokens + [1, 2], 32) == keys  # only whole blocks
    assert content_keys(ns, tokens, 32, 2) == keys[:2]
    assert probe_key(tokens[:15]) is None and probe_key(tokens) == probe_key(tokens[:16] + [0])


def _reference_content_keys(namespace, token_ids, tokens_per_block, num_blocks=None):  # noqa: ANN001, ANN202
    """The definition, written independently of the implementation: key i is ONE xxh3_128 over the
    namespace seed and the little-endian int64 bytes of every token of blocks 0..i. Keys are stored
    in the ledger, so they must never change bit for bit within a connector version."""
    import array
    import sys

    import xxhash

    whole = len(token_ids) // tokens_per_block
    n = whole if num_blocks is None else min(num_blocks, whole)
    packed = array.array("q", token_ids[: max(n, 0) * tokens_per_block])
    if sys.byteorder != "little":
        packed.byteswap()
    data = packed.tobytes()
    stride = tokens_per_block * 8
    return [xxhash.xxh3_128_digest(namespace.key_seed + data[: (i + 1) * stride]) for i in range(max(n, 0))]


def test_content_keys_are_bit_identical_to_the_reference_implementation() -> None:
    import random

    import numpy as np

    rng = random.Random(20261129)
    namespaces = [ns_of(LlmRequest(1, [1], 1)), ns_of(LlmRequest(1, [1], 1, cache_salt="t"))]
    for case in range(300):
        tpb = rng.choice([1, 2, 4, 16, 32, 64])
        length = rng.choice([0, 1, tpb - 1, tpb, rng.randrange(0, 40 * tpb + 1)])
        high = rng.choice([2**8, 2**17, 2**31, 2**63])
        tokens = [rng.randrange(-high if case % 7 == 0 else 0, high) for _ in range(length)]
        ns = namespaces[case % 2]
        limit = rng.choice([None, 0, 1, 3, length // max(tpb, 1) + 5])
        expected = _reference_content_keys(ns, tokens, tpb, limit)
        assert content_keys(ns, tokens, tpb, limit) == expected, (tpb, length, limit)
        assert content_keys(ns, np.array(tokens, dtype=np.int64), tpb, limit) == expected
        lazy = prefix_keys(ns, tokens, tpb, limit)  # what the lookup probes, one key at a time
        assert len(lazy) == len(expected)
        for i in rng.sample(range(-len(expected), len(expected)), min(4, 2 * len(expected))):
            assert lazy[i] == expected[i]
        assert list(lazy[: len(expected) // 2]) == expected[: len(expected) // 2] and list(lazy) == expected
        with pytest.raises(IndexError):
            lazy[len(expected)]


def test_keys_over_gil_sized_prefixes_are_hashed_in_slices_and_equal_the_reference(monkeypatch) -> None:
    """A prefix longer than python-xxhash's GIL threshold is fed in slices that keep the GIL on the
    engine's thread (every ``update`` at most GIL_HELD_BYTES); the keys are the definition's, bit for
    bit, on both sides of the threshold."""
    import types

    import xxhash

    from connector import namespace as nsmod

    ns = ns_of(LlmRequest(1, [1], 1))
    tokens = [(i * 7919) % 128_000 for i in range(32 * 1024 + 5)]
    cases = ((1, 8191), (1, 8192), (1, 8193), (32, 256), (32, 257), (32, 1024), (8192, 4))
    expected = {case: _reference_content_keys(ns, tokens, *case) for case in cases}
    updates: list[int] = []

    class RecordingHasher:
        def __init__(self, seed: bytes) -> None:
            self._hasher = xxhash.xxh3_128(seed)

        def update(self, data) -> None:  # noqa: ANN001
            updates.append(len(data))
            self._hasher.update(data)

        def digest(self) -> bytes:
            return self._hasher.digest()

    monkeypatch.setattr(nsmod, "xxhash", types.SimpleNamespace(xxh3_128=RecordingHasher))
    for (tpb, n), keys in expected.items():
        lazy = prefix_keys(ns, tokens, tpb, n)
        assert lazy[-1] == keys[-1] and lazy[n // 2] == keys[n // 2], (tpb, n)
    assert content_keys(ns, tokens, 8192, 4) == expected[(8192, 4)]
    assert max(updates) <= nsmod.GIL_HELD_BYTES and sum(1 for size in updates if size == nsmod.GIL_HELD_BYTES) > 4


def test_metadata_is_picklable_and_small() -> None:
    plan = LoadPlan(request_id=1, donor_id="d", provider_generation=0, namespace="n" * 32, mode="exact_equivalent",
                    target_block_ids=tuple(range(1024)), donor_block_start=0, num_blocks=1024, token_count=32768,
                    score_bucket="exact", lease_id="l" * 32, store_ref="d.kv", checksum="c" * 32,
                    donor_engine_id="A", donor_generation=1, layout="num_layers=2", freshness_policy="engine")
    save = SaveInstruction(request_id=2, donor_id="e", block_ids=(1, 2), num_blocks=2, tokens_per_block=32,
                           namespace="n", layout="x", probe=None, namespace_fields={"a": "b"})
    meta = ConnectorMetadata((plan,), (save,), 3)
    raw = pickle.dumps(meta)
    assert pickle.loads(raw) == meta
    assert len(raw) < 16_000 and meta.approx_size_bytes() >= len(raw) // 2


def test_connector_check_command(tmp_path, sqlite_db) -> None:
    import typer
    from typer.testing import CliRunner

    from connector.cli import register

    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a second command keeps typer in multi-command mode
    good = tmp_path / "good.toml"
    good.write_text(f'mode = "exact_equivalent"\nengine_id = "e"\ndb = "{sqlite_db}"\nstore_dir = "{tmp_path / "s"}"\n')
    result = CliRunner().invoke(app, ["connector-check", "--config", str(good)])
    assert result.exit_code == 0 and "connector ready: mode=exact_equivalent" in result.output
    bad = tmp_path / "bad.toml"
    bad.write_text('mode = "experimental"\n')
    result = CliRunner().invoke(app, ["connector-check", "--config", str(bad)])
    assert result.exit_code == 2 and "rule 5" in result.output
    # a discovery provider the engine could not resolve at start-up is not "ready" (newcomer, 2026-12-05)
    unknown = tmp_path / "unknown-provider.toml"
    unknown.write_text(good.read_text() + '[discovery]\nenabled = true\nproviders = ["nope.mod:Cls"]\n')
    result = CliRunner().invoke(app, ["connector-check", "--config", str(unknown)])
    assert result.exit_code == 2 and "discovery provider 'nope.mod:Cls'" in result.output, result.output


def test_a_misspelt_setting_variable_is_named(tmp_path, sqlite_db, monkeypatch) -> None:
    """pydantic-settings ignores a ``TRTLLM_SEMKV_*`` variable naming no field: ``TRTLLM_SEMKV_MDOE``
    left the engine in ``discovery_only`` without a word (newcomer, 2026-12-05)."""
    from connector.settings import unknown_env_settings

    assert unknown_env_settings({"TRTLLM_SEMKV_MDOE": "x", "TRTLLM_SEMKV_MODE": "x", "TRTLLM_SEMKV_CONFIG": "c",
                                 "TRTLLM_SEMKV_DISCOVERY__ENABLED": "1", "PATH": "/bin"}) == ["TRTLLM_SEMKV_MDOE"]
    monkeypatch.setenv("TRTLLM_SEMKV_MDOE", "exact_equivalent")
    monkeypatch.setenv("TRTLLM_SEMKV_DB", sqlite_db)
    monkeypatch.setenv("TRTLLM_SEMKV_STORE_DIR", str(tmp_path / "s"))
    result = subprocess.run([sys.executable, "-m", "ledger", "connector-check"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "warning: TRTLLM_SEMKV_MDOE names no connector setting" in result.stderr
    assert "mode=discovery_only" in result.stdout


def test_non_finite_connector_settings_are_refused(monkeypatch) -> None:
    """``donor_ttl_s = inf`` wrote ``"expires_at": Infinity`` into `inspect --json` (not JSON); ``nan``
    passed every bound it was compared with."""
    for name, value in (("DONOR_TTL_S", "inf"), ("LOOKUP_TIMEOUT_S", "nan"), ("PROFIT__MARGIN", "inf")):
        with monkeypatch.context() as env:
            env.setenv(f"TRTLLM_SEMKV_{name}", value)
            with pytest.raises(ConnectorConfigError, match="finite number"):
                load_connector_settings({}, environ={})


def test_a_kv_layout_that_does_not_parse_is_refused_at_load() -> None:
    """``kv_layout = "garbage"`` passed connector-check; the engine then treated every request's
    namespace as unknown (nothing materialized, one log line). Now refused where the settings load."""
    for bad in ("garbage", "num_layers=32,kv_factor=2", "num_layers=32,kv_factor=3,block_elems=4096",
                "num_layers=0,kv_factor=2,block_elems=4096", "num_layers=32,kv_factor=2,block_elems=4096,x=1"):
        with pytest.raises(ConnectorConfigError, match="namespace.kv_layout"):
            load_connector_settings({"namespace": {"kv_layout": bad}}, environ={})
    settings = load_connector_settings({"namespace": {"kv_layout": "num_layers=32, kv_factor=1, block_elems=576"}},
                                       environ={})
    assert kv_layout_dims(settings.namespace.kv_layout) == (32, 1, 576)


def test_a_table_from_the_environment_that_is_not_json_is_named(monkeypatch) -> None:
    monkeypatch.setenv("TRTLLM_SEMKV_DISCOVERY", "{enabled: true}")
    with pytest.raises(ConnectorConfigError, match="TRTLLM_SEMKV_DISCOVERY is not valid JSON: Expecting property name"):
        load_connector_settings({}, environ={})


def test_connector_check_warns_when_a_materializing_engine_has_no_engine_id(tmp_path, sqlite_db) -> None:
    """The docs' fleet example had no engine_id (it differs per host) and connector-check said
    "ready": such an engine never registers a donor of its own."""
    import typer
    from typer.testing import CliRunner

    from connector.cli import register

    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    for mode, engine_id, warned in (("exact_equivalent", "", True), ("exact_equivalent", 'engine_id = "e"\n', False),
                                    ("discovery_only", "", False)):
        config = tmp_path / f"{mode}-{warned}.toml"
        config.write_text(f'mode = "{mode}"\n{engine_id}db = "{sqlite_db}"\nstore_dir = "{tmp_path / "s"}"\n')
        result = CliRunner().invoke(app, ["connector-check", "--config", str(config)])
        assert result.exit_code == 0 and "connector ready" in result.output, result.output
        assert ("warning: engine_id is not set" in result.output) == warned, result.output


def test_an_engine_id_with_a_control_character_is_refused() -> None:
    with pytest.raises(ConnectorConfigError, match="an engine id cannot hold control characters"):
        load_connector_settings({"engine_id": "trt\n0"}, environ={})


def test_connector_check_warns_when_the_store_capacity_exceeds_its_file_system(tmp_path, sqlite_db) -> None:
    import shutil

    import typer
    from typer.testing import CliRunner

    from connector.cli import register

    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    total = shutil.disk_usage(tmp_path).total
    for capacity, warned in ((2**20, False), (total * 10, True)):
        config = tmp_path / f"c{capacity}.toml"
        config.write_text(f'mode = "exact_equivalent"\nengine_id = "e"\ndb = "{sqlite_db}"\n'
                          f'store_dir = "{tmp_path / "s"}"\nstore_capacity_bytes = {capacity}\n')
        result = CliRunner().invoke(app, ["connector-check", "--config", str(config)])
        assert result.exit_code == 0 and "connector ready" in result.output, result.output
        assert ("is more than the file system of" in result.output) == warned, result.output
