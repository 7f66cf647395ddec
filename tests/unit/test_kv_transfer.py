"""KV hand-off between the pools: connector parameters, stored-KV lifetime (no engines)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.engines.config import EngineConfig, EngineRole, KvConnectorConfig, KvConnectorKind
from app.engines.messages import EngineRequest, SamplingSpec
from app.engines.vllm import (
    NIXL_PREFILL_PARAMS,
    VllmBackend,
    example_kv_loadable,
    example_storage_key,
)
from app.serving.kv_transfer import ConnectorTransport

pytestmark = pytest.mark.unit

NIXL = KvConnectorConfig(kind=KvConnectorKind.NIXL, side_channel_port=5601)
REMOTE = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e-1",
          "remote_block_ids": [3, 4, 5], "remote_host": "10.0.0.7", "remote_port": 5601,
          "tp_size": 1}


def vllm_backend(role: EngineRole, connector: KvConnectorConfig) -> VllmBackend:
    config = EngineConfig(gpu_type="H800", backend="vllm", model_path="/models/m", role=role,
                          kv_connector=connector)
    return VllmBackend(f"{role.value}-0", config)


def test_nixl_prefill_keeps_its_kv_for_a_remote_decode_and_returns_where_it_is():
    prefill = vllm_backend(EngineRole.PREFILL, NIXL)
    request = EngineRequest("r:prefill", (1, 2, 3), SamplingSpec(max_tokens=1))
    assert prefill._kv_params_in(request) == NIXL_PREFILL_PARAMS
    assert prefill._kv_params_out(SimpleNamespace(kv_transfer_params=REMOTE), [1, 2, 3]) == REMOTE
    assert prefill.engine_kwargs()["kv_transfer_config"] == {
        "kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cuda"}


def test_nixl_decode_passes_the_prefills_parameters_on_unchanged():
    decode = vllm_backend(EngineRole.DECODE, NIXL)
    request = EngineRequest("r", (1, 2, 3), SamplingSpec(max_tokens=8), resume_token_ids=(9,),
                            kv_transferred=True, kv_transfer_params=REMOTE)
    assert decode._kv_params_in(request) == REMOTE
    assert decode._kv_params_out(SimpleNamespace(kv_transfer_params=None), [1]) is None


def test_the_storage_key_is_the_example_connectors_own_directory(tmp_path):
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
        ExampleConnector,
    )

    prompt = list(range(7, 307))
    ours = example_storage_key(prompt, 128, str(tmp_path))
    stored = torch.tensor(prompt)[:256]  # what the prefill engine stores (whole blocks - 1)
    theirs = ExampleConnector._generate_foldername_debug(
        SimpleNamespace(_storage_path=str(tmp_path)), stored, [], create_folder=False)
    assert ours == theirs
    # the decode engine looks it up from prompt + the first token: the same directory
    lookup = torch.tensor(prompt + [11])[:256]
    assert ExampleConnector._generate_foldername_debug(
        SimpleNamespace(_storage_path=str(tmp_path)), lookup, [], create_folder=False) == ours


def example_transport(root, ttl_s: float = 60.0, clock=time.time) -> ConnectorTransport:
    config = KvConnectorConfig(kind=KvConnectorKind.EXAMPLE, shared_storage_path=str(root),
                               kv_ttl_s=ttl_s)
    return ConnectorTransport(config, bandwidth_gbps=10.0, clock=clock)


async def test_loaded_kv_is_deleted_and_nothing_outside_the_storage_root(tmp_path):
    root = tmp_path / "kv"
    stored = root / "abc123"
    stored.mkdir(parents=True)
    (stored / "layer.0.safetensors").write_bytes(b"kv")
    outside = tmp_path / "keep"
    outside.mkdir()
    transport = example_transport(root)
    handoff = await transport.transfer(300, 131072, 0.0, {"storage_key": str(stored)})
    assert handoff.params == {"storage_key": str(stored)} and handoff.transfer_s is None
    assert transport.link.num_transfers == 1  # the placement model saw it
    transport.release(handoff.params)
    assert not stored.exists()
    transport.release({"storage_key": str(outside)})
    transport.release({"storage_key": str(root / ".." / "keep")})
    assert outside.exists()
    with pytest.raises(RuntimeError, match="no KV transfer parameters"):
        await transport.transfer(300, 131072, 0.0, None)


async def test_kv_no_decode_loaded_is_deleted_after_its_lifetime(tmp_path):
    now = [time.time()]
    transport = example_transport(tmp_path, ttl_s=60.0, clock=lambda: now[0])
    old, fresh = tmp_path / "old", tmp_path / "fresh"
    for d in (old, fresh):
        d.mkdir()
    os.utime(old, (now[0] - 120, now[0] - 120))
    await transport.transfer(10, 1.0, 0.0, {"storage_key": str(fresh)})
    assert not old.exists() and fresh.exists()
    os.utime(fresh, (now[0] - 61, now[0] - 61))
    now[0] += 10  # within a quarter of the TTL: no second sweep yet
    await transport.transfer(10, 1.0, 0.0, {"storage_key": str(fresh)})
    assert fresh.exists()
    now[0] += 10
    await transport.transfer(10, 1.0, 0.0, {"storage_key": str(fresh)})
    assert not fresh.exists()


def test_a_prompt_of_whole_blocks_is_not_handed_over_by_the_example_connector():
    """Stored span (n - 1) // b * b, loaded span n // b * b: equal unless b divides n."""
    assert example_kv_loadable(300, 128) and example_kv_loadable(129, 128)
    assert not example_kv_loadable(256, 128) and not example_kv_loadable(128, 128)


def test_a_prefill_of_whole_blocks_deletes_its_kv_and_returns_no_hand_off(tmp_path):
    connector = KvConnectorConfig(kind=KvConnectorKind.EXAMPLE, shared_storage_path=str(tmp_path))
    prefill = vllm_backend(EngineRole.PREFILL, connector)
    prefill.engine = SimpleNamespace(vllm_config=SimpleNamespace(
        cache_config=SimpleNamespace(block_size=128)))
    whole = list(range(256))
    stored = example_storage_key(whole, 128, str(tmp_path))
    Path(stored).mkdir()
    assert prefill._kv_params_out(SimpleNamespace(), whole) is None
    assert not Path(stored).exists()
    ragged = list(range(300))
    assert prefill._kv_params_out(SimpleNamespace(), ragged) == {
        "storage_key": example_storage_key(ragged, 128, str(tmp_path))}
