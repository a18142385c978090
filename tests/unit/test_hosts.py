"""`weightsync.hosts` and the checks `WeightSync` makes with it when built: no packet
is sent (a UDP connect picks a route, a bind checks an address is assigned here).
198.51.100.7 (TEST-NET-2, RFC 5737) stands for an engine on another host."""

from __future__ import annotations

import pytest

import weightsync as ws
from weightsync.hosts import is_local_host, is_loopback, local_address_towards, url_host

ELSEWHERE = "198.51.100.7"


def test_local_and_other_hosts() -> None:
    assert is_local_host("127.0.0.1") and is_local_host("localhost")
    assert not is_local_host(ELSEWHERE)
    assert is_loopback("127.0.0.1") and not is_loopback(ELSEWHERE)
    assert local_address_towards("127.0.0.1") == "127.0.0.1"
    assert url_host(f"http://{ELSEWHERE}:30000/") == ELSEWHERE


def test_shm_to_an_engine_on_another_host_is_refused_when_built() -> None:
    engine = ws.SGLangEngine(f"http://{ELSEWHERE}:30000")
    with pytest.raises(ValueError, match="another host") as refused:
        ws.WeightSync([engine], transport="shm")
    for works in ("broadcast", "disk", "http"):
        assert works in str(refused.value)
    ws.WeightSync([ws.SGLangEngine("http://127.0.0.1:30000")], transport="shm").close()  # same host: fine


def test_broadcast_hosted_on_loopback_for_an_engine_elsewhere_is_refused_when_built() -> None:
    engine = ws.SGLangEngine(f"http://{ELSEWHERE}:30000")
    with pytest.raises(ValueError, match="master_address='127.0.0.1', this host's loopback: pass master_address="):
        ws.WeightSync([engine], transport="broadcast")


def test_a_mesh_that_did_not_form_says_what_to_set() -> None:
    from weightsync.formats.groups import _mesh_hint

    refused = ("Gloo connectFullMesh failed with [pair.cc:152] timed out connecting: SO_ERROR: Connection refused, "
               "remote=[127.0.0.1]:16770")
    hint = _mesh_hint(refused, "10.0.0.2")
    assert "this rank bound 10.0.0.2" in hint or "GLOO_SOCKET_IFNAME" in hint
    assert "a peer advertised a loopback address" in hint
    assert "set GLOO_SOCKET_IFNAME to its interface towards the trainer" in hint
    assert "master_address" in _mesh_hint("Gloo connectFullMesh failed: Connect timeout", "10.0.0.2")
    assert _mesh_hint("some other failure", "10.0.0.2") == ""
