"""Nobody gets in: the admin key, the bind address, the pickle allow-list, disk
paths and size limits of `weightsync serve`.

tests/integration/test_server_bad_input.py already proves, and is not repeated
here: every route in its MUTATING list answers 401 without a key or with a wrong
one; os.system and builtins.eval pickles are refused over HTTP; model_path
escapes (absolute, `..`, a symlinked directory, a symlink inside a directory,
/etc) are 403; a bucket frame over its limit is 413. tests/unit/server/
test_server_unpickle.py refuses os.system, subprocess.Popen, eval, exec,
getattr, __import__ and torch.load by name for pickle protocols 0-5.

Added here: the key check covers EVERY route the server has (from its own route
table) and near-miss keys; the comparison is hmac.compare_digest; the default
bind is loopback and unreachable from other interfaces; crafted pickles that
hide a callable (functools.partial, nested REDUCE, INST/OBJ/NEWOBJ opcodes,
copyreg, posix.system, a storage whose header names a global) never run, over
both pickle routes; LoRA paths are confined like model paths; a JSON body over
64 MiB is refused (413) before it is read, and streamed past the limit; a
manifest.json or a bucket header over the limit is refused.
"""

from __future__ import annotations

import base64
import functools
import hmac
import os
import pickle
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

import sglang_wheel
from fault_helpers import READ_ONLY, app_routes
from weightsync.formats.version_dir import MAX_MANIFEST_BYTES, bucket_file_name
from weightsync.server.launch import ServerProcess
from weightsync.server.routes_common import HTTPError, require_admin
from weightsync.server.unpickle import UnsafePickleError, safe_loads
from weightsync_tools.faults import ADMIN_KEY, Rig

# fixtures admin, keyed_server, keyed_root, rig, fault_model: tests/support/fault_fixtures.py
pytestmark = pytest.mark.faults

JSON_LIMIT = 64 << 20  # ServerConfig.max_json_bytes


@pytest.fixture(scope="module")
def served(admin: httpx.Client) -> dict[str, str]:
    return dict(admin.post("/weightsync/digests", json={}).json()["digests"])


@pytest.fixture(autouse=True)
def weights_unchanged(admin: httpx.Client, served: dict[str, str]) -> Iterator[None]:
    yield
    admin.post("/weightsync/abort", json={})
    assert admin.post("/weightsync/digests", json={}).json()["digests"] == served


# -- the admin key ---------------------------------------------------------------------------------


def test_every_route_but_the_read_only_ones_needs_the_admin_key(keyed_server: ServerProcess) -> None:
    near_misses = {
        "none": {},
        "wrong": {"Authorization": "Bearer wrong"},
        "prefix": {"Authorization": f"Bearer {ADMIN_KEY[:-1]}"},
        "suffix": {"Authorization": f"Bearer {ADMIN_KEY}x"},
        "other scheme": {"Authorization": f"Basic {ADMIN_KEY}"},
        "no scheme": {"Authorization": ADMIN_KEY},
        "non-ascii": {"Authorization": b"Bearer caf\xe9"},
        "other header": {"X-Api-Key": ADMIN_KEY},
    }
    routes = sorted(set(app_routes()) - READ_ONLY)
    assert len(routes) >= 18
    with httpx.Client(base_url=keyed_server.url, timeout=60) as anonymous:
        for route in routes:
            for what, headers in near_misses.items():
                response = anonymous.post(route, json={"admin_api_key": ADMIN_KEY}, headers=headers,
                                          params={"api_key": ADMIN_KEY})
                assert response.status_code == 401, f"{route} with {what} key: {response.status_code}"
                assert response.json()["success"] is False


def test_every_route_sglang_also_has_takes_the_key_as_sglang_does(keyed_server: ServerProcess) -> None:
    """With an admin key set, a route SGLang declares `ADMIN_OPTIONAL` or `ADMIN_FORCE` answers
    401 without the key, and one it declares `NORMAL` (or a health route) answers without it,
    the levels read from SGLang 0.5.23's own `http_server.py` (`/flush_cache` was open here)."""
    sglang_levels = sglang_wheel.route_auth_levels()
    shared = sorted((path, method) for path, methods in app_routes().items() for method in methods
                    if (path, method) in sglang_levels)
    assert len(shared) >= 30, shared  # every SGLang route this server has (32 of them), by path and method
    assert sglang_levels[("/flush_cache", "POST")] == "admin_optional"
    wrong = []
    with httpx.Client(base_url=keyed_server.url, timeout=60) as anonymous:
        for path, method in shared:
            level = sglang_levels[(path, method)]
            if path in {"/generate", "/health_generate"}:
                status = anonymous.request(method, path, json={"input_ids": "not a list"}).status_code
            else:
                status = anonymous.request(method, path, json={}).status_code
            needs_key = level in {"admin_optional", "admin_force"}
            if (status == 401) != needs_key:
                wrong.append(f"{method} {path}: SGLang {level}, here {status} without the key")
    assert not wrong, "\n".join(wrong)


def test_the_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    import weightsync.server.routes_common as server_http

    monkeypatch.setattr(server_http.hmac, "compare_digest", spy)
    for token, ok in ((ADMIN_KEY, True), ("wrong", False), (ADMIN_KEY + "x", False)):
        request = SimpleNamespace(headers={"authorization": f"Bearer {token}"}, state=SimpleNamespace())
        if ok:
            require_admin(request, ADMIN_KEY)  # type: ignore[arg-type]
        else:
            with pytest.raises(HTTPError) as info:
                require_admin(request, ADMIN_KEY)  # type: ignore[arg-type]
            assert info.value.status == 401
    assert calls == [(t.encode(), ADMIN_KEY.encode()) for t in (ADMIN_KEY, "wrong", ADMIN_KEY + "x")]


# -- the bind address ------------------------------------------------------------------------------


def _other_addresses() -> list[str]:
    """This machine's non-loopback IPv4 addresses."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        out = []
    return [a for a in out if a.count(".") == 3 and not a.startswith("127.")]


def test_default_bind_is_loopback(rig: Rig) -> None:
    import argparse

    from weightsync.cli import serve
    from weightsync.server.config import ServerConfig

    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    assert parser.parse_args(["serve", "--model", "m"]).host == "127.0.0.1"
    assert ServerConfig(model_dir=Path(".")).host == "127.0.0.1"
    # The rig's server was started without --host; its listening line says loopback.
    assert rig.url.startswith("http://127.0.0.1:")
    port = int(rig.url.rsplit(":", 1)[1])
    for address in _other_addresses():
        with socket.socket() as s:
            s.settimeout(5)
            assert s.connect_ex((address, port)) != 0, f"reachable on {address}:{port}"


# -- crafted pickles -------------------------------------------------------------------------------


class _Reduces:
    """Pickles as `func(*args)`: what an attacker's pickle asks the unpickler to call."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> Any:
        return self.func, self.args


def _crafted(markers: Path) -> dict[str, bytes]:
    """Pickles that each create `markers/<name>` when loaded by a plain unpickler."""
    import collections
    import copy as copy_module

    import torch

    def touch(name: str) -> str:
        return f"touch {markers / name}"

    def op_string(text: str) -> bytes:
        return b"X" + struct.pack("<I", len(text)) + text.encode()

    system = lambda name: _Reduces(os.system, touch(name))  # noqa: E731
    return {
        "os-system": pickle.dumps([("model.norm.weight", system("os-system"))]),
        "posix-system-protocol-0": pickle.dumps([("w", system("posix-system-protocol-0"))], protocol=0),
        "partial-called": pickle.dumps([("w", _Reduces(functools.partial(os.system, touch("partial-called"))))]),
        "in-allowed-ordereddict": pickle.dumps(_Reduces(collections.OrderedDict,
                                                        [("w", system("in-allowed-ordereddict"))])),
        "in-allowed-tensor-rebuild": pickle.dumps([("w", _Reduces(torch._utils._rebuild_tensor_v2,
                                                                  system("in-allowed-tensor-rebuild"),
                                                                  0, (1,), (1,), False, None))]),
        "getattr-import-chain": (b"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(S'os'\ntRS'system'\ntR(S'"
                                 + touch("getattr-import-chain").encode() + b"'\ntR."),
        "copy-deepcopy-reduce": pickle.dumps([("w", _Reduces(copy_module.deepcopy,
                                                              system("copy-deepcopy-reduce")))]),
        "inst-opcode": f"(S'{touch('inst-opcode')}'\nios\nsystem\np0\n.".encode(),
        "obj-opcode": b"\x80\x02(cposix\nsystem\n" + op_string(touch("obj-opcode")) + b"o.",
        "stack-global": (b"\x80\x04\x8c\x02os\x8c\x06system\x93" + op_string(touch("stack-global"))
                         + b"\x85R."),
        "storage-bytes": pickle.dumps(_Reduces(torch.storage._load_from_bytes,
                                               pickle.dumps(system("storage-bytes")))),
    }


LOAD_ALL = """
import pickle, sys, torch
for path in sys.argv[1:]:
    try:
        pickle.loads(open(path, "rb").read())
    except Exception:
        pass  # the call ran before anything failed
"""


def test_the_crafted_pickles_are_live(tmp_path: Path) -> None:
    """Each payload below really runs its command under a plain unpickler (in a child)."""
    markers = tmp_path / "markers"
    markers.mkdir()
    files = []
    for name, data in _crafted(markers).items():
        files.append(tmp_path / f"{name}.pickle")
        files[-1].write_bytes(data)
    subprocess.run([sys.executable, "-c", LOAD_ALL, *map(str, files)], check=True, timeout=120,
                   capture_output=True)
    assert sorted(p.name for p in markers.iterdir()) == sorted(_crafted(markers))


def test_crafted_pickles_are_refused_without_running(admin: httpx.Client, tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    for name, data in _crafted(markers).items():
        with pytest.raises(UnsafePickleError, match="refused"):
            safe_loads(data)
        entry = base64.b64encode(data).decode()
        refused = admin.post("/update_weights_from_tensor", json={"serialized_named_tensors": [entry]})
        assert refused.status_code == 400, f"{name}: {refused.status_code} {refused.text}"
        assert "refused" in refused.json()["message"], f"{name}: {refused.json()['message']}"
        lora = admin.post("/load_lora_adapter_from_tensors", json={
            "lora_name": "evil", "serialized_named_tensors": [entry],
            "config_dict": {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "peft_type": "LORA"}})
        assert lora.status_code == 400 and "refused" in lora.json()["message"], f"{name}: {lora.text}"
    assert list(markers.iterdir()) == [], "a crafted pickle ran code"


# -- disk paths ------------------------------------------------------------------------------------


def test_lora_paths_are_confined_to_the_disk_root(admin: httpx.Client, keyed_root: Path,
                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    outside = tmp_path_factory.mktemp("outside-adapter")
    (outside / "adapter_config.json").write_text("{}")
    (outside / "adapter_model.safetensors").write_bytes(b"")
    link = keyed_root / "adapter-link"
    link.symlink_to(outside, target_is_directory=True)
    inner = keyed_root / "adapter-with-a-linked-file"
    inner.mkdir()
    (inner / "adapter_config.json").symlink_to(outside / "adapter_config.json")
    for path in (str(outside), f"{keyed_root}/../{outside.name}", str(link), str(inner), "/etc"):
        response = admin.post("/load_lora_adapter", json={"lora_name": "escape", "lora_path": path})
        assert response.status_code == 403, f"{path}: {response.status_code} {response.text}"
        assert "outside the allowed root" in response.json()["message"]


def test_shm_names_are_confined_to_the_weightsync_namespace(admin: httpx.Client) -> None:
    info = admin.get("/weightsync/info").json()
    from weightsync.bucketing import plan_buckets
    from weightsync.dtypes import dtype_from_name
    from weightsync.manifest import Manifest, TensorMeta

    metas = [TensorMeta(hf_name=n, dtype=dtype_from_name(p["dtype"]), shape=tuple(p["shape"]))
             for n, p in info["params"].items()]
    version = int(info["weight_version"]) + 1
    manifest = Manifest(version=version, mode="full", buckets=plan_buckets(metas, 1 << 20))
    assert admin.post("/weightsync/begin", json={"manifest": manifest.to_dict()}).status_code == 200
    for name in ("../../etc/passwd", "/dev/shm/../../etc/passwd", "psm_123", "weightsync-../../x"):
        response = admin.post("/weightsync/shm_bucket", json={
            "version": version, "index": 0, "digest": "0" * 16, "shm_name": name, "slot_bytes": 1 << 20,
            "num_slots": 2, "slot": 0})
        assert response.status_code == 400 and "must match" in response.json()["message"], response.text


# -- size limits -----------------------------------------------------------------------------------


def _raw_request(url: str, head: str) -> str:
    """Send request headers only (no body) and return the status line of the answer."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head.encode())
        answer = b""
        while b"\r\n" not in answer and (chunk := s.recv(4096)):  # TCP may split the status line
            answer += chunk
        return answer.decode(errors="replace").split("\r\n", 1)[0]


def test_a_json_body_over_the_limit_is_refused_before_it_is_read(keyed_server: ServerProcess) -> None:
    head = (f"POST /weightsync/begin HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {JSON_LIMIT + 1}\r\n\r\n")
    assert " 413 " in _raw_request(keyed_server.url, head)  # answered with no byte of the body sent


def test_a_streamed_body_past_the_limit_is_refused(admin: httpx.Client) -> None:
    chunk = b" " * (1 << 20)

    def body() -> Iterator[bytes]:  # chunked: no Content-Length to refuse up front
        yield b"{"
        for _ in range(JSON_LIMIT // len(chunk)):
            yield chunk
        yield b"}"

    response = admin.post("/weightsync/begin", content=body(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413, response.text


def test_oversized_manifest_and_bucket_header_on_disk_are_refused(admin: httpx.Client, keyed_root: Path) -> None:
    big = keyed_root / "huge-manifest"
    big.mkdir()
    with open(big / "manifest.json", "wb") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)  # sparse: the size is what is checked, before reading
    response = admin.post("/update_weights_from_disk", json={"model_path": str(big)})
    assert response.status_code == 400 and "limit" in response.json()["message"], response.text

    info = admin.get("/weightsync/info").json()
    from weightsync.bucketing import plan_buckets
    from weightsync.dtypes import dtype_from_name
    from weightsync.formats.version_dir import write_manifest
    from weightsync.manifest import Manifest, TensorMeta

    metas = [TensorMeta(hf_name=n, dtype=dtype_from_name(p["dtype"]), shape=tuple(p["shape"]))
             for n, p in info["params"].items()]
    plan = plan_buckets(metas, 16 << 20)
    manifest = Manifest(version=int(info["weight_version"]) + 1, mode="full", buckets=plan)
    manifest = manifest.with_digests(["0" * 16] * len(plan))
    forged = keyed_root / "huge-header"
    forged.mkdir()
    write_manifest(forged, manifest)
    (forged / bucket_file_name(0)).write_bytes(struct.pack("<Q", 1 << 62) + b"{}")
    response = admin.post("/update_weights_from_disk", json={"model_path": str(forged)})
    assert response.status_code == 400 and "too large" in response.json()["message"], response.text
