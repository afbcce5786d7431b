"""The typed wire contracts: each shape writes the exact keys (and order) clients and routers have always seen,
and what one instance writes the next one parses back to the same value."""

import dataclasses
import subprocess
import sys

import pytest

from pdserve.ec_transfer.params import ECSource, parse_ec_params
from pdserve.ids import TransferId
from pdserve.kv_transfer.params import (DecodeFirst, KVParamsError, PushHeld, RemoteDecode, RemotePrefill,
                                        parse_kv_params, parse_release)

XFER = TransferId("xfer-1")


def pull(transfer_id: TransferId | None = XFER) -> RemotePrefill:
    return RemotePrefill(engine_id="e", host="127.0.0.1", port=5600, remote_key="cmpl-a-0-1234", block_ids=(3, 4),
                         token="t" * 32, transfer_id=transfer_id, mode="pull", num_tokens=20, cached_tokens=0)


def test_p_pull_answer_keeps_vllm_order_and_parses_back():
    wire = pull().to_wire()
    assert list(wire) == ["do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                          "remote_request_id", "remote_host", "remote_port", "tp_size", "transfer_token",
                          "remote_num_tokens", "transfer_mode", "remote_prefill_cached_tokens", "transfer_id"]
    assert wire["remote_block_ids"] == [[3, 4]]
    assert parse_kv_params(wire, max_blocks=8) == pull()
    assert "transfer_id" not in pull(None).to_wire()
    bound = dataclasses.replace(pull(), prompt_hash="ab" * 16)  # pdserve's extra goes last; absent when unknown
    assert list(bound.to_wire())[-1] == "remote_prompt_hash" and parse_kv_params(bound.to_wire(), 8) == bound


def test_gateway_legs_parse_back():
    assert RemoteDecode(XFER).to_wire() == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": XFER}
    assert list(RemoteDecode(XFER, push=True).to_wire())[-1] == "transfer_mode"
    for value in (RemoteDecode(XFER), RemoteDecode(XFER, push=True), DecodeFirst("http://p:1", XFER)):
        assert parse_kv_params(value.to_wire(), max_blocks=8) == value
    push = RemotePrefill(engine_id="e", host="h", port=1, remote_key=None, block_ids=None, token=None,
                         transfer_id=XFER, mode="push")
    assert list(push.to_wire()) == ["do_remote_prefill", "do_remote_decode", "transfer_mode", "transfer_id",
                                    "remote_engine_id", "remote_host", "remote_port"]
    assert parse_kv_params(push.to_wire(), max_blocks=8) == push
    assert list(PushHeld(XFER, 20, 0).to_wire()) == ["do_remote_prefill", "do_remote_decode", "transfer_id",
                                                    "transfer_mode", "remote_num_tokens",
                                                    "remote_prefill_cached_tokens"]


def test_malformed_params_and_releases_are_refused():
    with pytest.raises(KVParamsError, match="remote_port"):
        parse_kv_params({**pull().to_wire(), "remote_port": "x"}, max_blocks=8)
    with pytest.raises(KVParamsError, match="more than a prompt can use"):
        parse_kv_params(pull().to_wire(), max_blocks=1)
    assert parse_kv_params({"do_remote_prefill": False}, max_blocks=8) is None
    with pytest.raises(KVParamsError, match="a release names"):
        parse_release({"transfer_token": "t"})
    assert parse_release({"transfer_id": XFER}).transfer_id == XFER


def test_p_ids_built_from_long_external_ids_reach_d():
    """P's own id is the external id plus what the engine adds ("chatcmpl-", a prompt index, a random suffix): from
    a 256-character X-Request-Id (pdserve's bound) or an unbounded one (vLLM builds its ids from whatever it got, up
    to the 8 KiB a header line may carry), a decode instance takes it as P handed it out."""
    for rid in (f"chatcmpl-{'r' * 256}-1a2b3c4d", f"cmpl-{'r' * 8192}-0-1a2b3c4d"):
        wire = {**pull().to_wire(), "remote_request_id": rid}
        assert parse_kv_params(wire, max_blocks=8) == dataclasses.replace(pull(), remote_key=rid)
    with pytest.raises(KVParamsError, match="remote_request_id"):
        parse_kv_params({**pull().to_wire(), "remote_request_id": "r" * 9000}, max_blocks=8)
    with pytest.raises(KVParamsError, match="remote_engine_id"):
        parse_kv_params({**pull().to_wire(), "remote_engine_id": "e" * 300}, max_blocks=8)


def test_ec_sources_round_trip_and_stay_lenient():
    p2p = ECSource(connector="ECP2PConnector", num_embeds=576, checksum=7, host="h", port=9, engine_id="e",
                   token="t")
    storage = ECSource(connector="ECStorageConnector", num_embeds=576, checksum=7)
    assert "remote_host" not in storage.to_wire()
    sources = parse_ec_params({"a": p2p.to_wire(), "b": storage.to_wire(), "c": {"do_remote_encode": False},
                               "d": "junk", "e": {"do_remote_encode": True, "checksum": "x"}})
    assert sources["a"] == p2p and sources["b"] == storage and set(sources) == {"a", "b", "e"}
    assert "checksum" in sources["e"].error  # loaded as a failure, so the item is encoded locally
    assert parse_ec_params(None) == {}


def test_contracts_import_no_torch():
    code = ("import sys, pdserve.kv_transfer.params, pdserve.ec_transfer.params, pdserve.gateway.app; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
