"""Bad-input fuzzing of every mutating endpoint of `weightsync serve` (hypothesis).

Random and garbled JSON bodies (right field names with wrong values, wrong
types, random keys, non-JSON bytes), random pickles, near-valid manifests and
random binary bucket frames. For every request: no 5xx (the one documented 5xx,
504 for a weight-update group that did not form, is allowed on
/init_weights_update_group only), every refusal is a JSON `success: false`; after
each endpoint's run the server still answers /health and /generate and serves
bit-identical weights (digests). The server must not log a traceback (checked
when it stops). Examples are derandomized and bounded (well under a minute).

The endpoint list comes from the server's own route table, so a new mutating
route is fuzzed (and must be listed with its fields) automatically.
"""

from __future__ import annotations

import base64
import json
import pickle
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fault_helpers import READ_ONLY, app_routes
from serve_check import wait_until
from weightsync.formats.wire import MAGIC

# fixtures admin, keyed_server, keyed_root, fault_model: tests/support/fault_fixtures.py
pytestmark = pytest.mark.faults

EXAMPLES = 30
FIELDS: dict[str, tuple[str, ...]] = {
    "/pause_generation": ("mode",),
    "/continue_generation": (),
    "/begin_weight_update": ("selector",),
    "/end_weight_update": (),
    "/update_weights_from_disk": ("model_path", "weight_version", "flush_cache", "abort_all_requests", "load_format"),
    "/update_weights_from_tensor": ("serialized_named_tensors", "load_format", "weight_version", "flush_cache",
                                    "abort_all_requests"),
    "/update_weight_version": ("new_version", "abort_all_requests"),
    "/init_weights_update_group": ("master_address", "master_port", "rank_offset", "world_size", "group_name",
                                   "backend"),
    "/destroy_weights_update_group": ("group_name",),
    "/update_weights_from_distributed": ("names", "dtypes", "shapes", "group_name", "load_format", "weight_version",
                                         "weightsync_version", "weightsync_bucket", "weightsync_digest"),
    "/weightsync/begin": ("manifest",),
    "/weightsync/bucket": (),
    "/weightsync/shm_bucket": ("version", "index", "digest", "shm_name", "slot_bytes", "num_slots", "slot"),
    "/weightsync/receive": ("version", "index", "digest", "link", "delivery"),
    "/weightsync/commit": ("version",),
    "/weightsync/abort": ("version",),
    "/weightsync/rollback": ("version", "owner"),
    "/weightsync/relay": ("version", "group_name", "source_rank", "source_label", "forward_rank", "forward_label"),
    "/load_lora_adapter": ("lora_name", "lora_path", "pinned"),
    "/load_lora_adapter_from_tensors": ("lora_name", "config_dict", "serialized_named_tensors", "load_format",
                                        "expected_checksums", "pinned"),
    "/unload_lora_adapter": ("lora_name",),
    "/abort_request": ("rid", "abort_all"),
    "/release_memory_occupation": ("tags",),
    "/resume_memory_occupation": ("tags",),
    "/weights_checker": ("action", "allow_quant_error", "skip_tensor_list", "selector"),
    "/flush_cache": (),
    "/get_weights_by_name": ("name", "truncate_size"),
}
ALLOWED_5XX = {"/init_weights_update_group": {504}}


def test_every_mutating_route_is_fuzzed() -> None:
    assert set(app_routes()) - READ_ONLY == set(FIELDS)


# -- strategies ------------------------------------------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["", "0", "-1", "1e309", "nan", "all", "abort", "gloo",
                                                           "flattened_bucket", "../..", "/etc", "weightsync-x"]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def pickled(obj: Any) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


@st.composite
def pickled_tensors(draw: st.DrawFn) -> str:
    """A base64 pickle of (name, tensor) pairs whose names the model does not have."""
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8]))
    names = draw(st.lists(st.text(max_size=10).map(lambda s: f"fuzz.{s}"), min_size=1, max_size=3))
    if draw(st.booleans()):
        return pickled({"flattened_tensor": torch.zeros(draw(st.integers(0, 64)), dtype=torch.uint8),
                        "metadata": [{"name": n, "shape": shape, "dtype": dtype,
                                      "start_idx": draw(st.integers(-8, 80)), "end_idx": draw(st.integers(-8, 80))}
                                     for n in names]})
    return pickled([(n, torch.zeros(shape, dtype=dtype)) for n in names])


ints = st.one_of(st.integers(-3, 40), st.integers(-(2**70), 2**70),
                 st.sampled_from([2**31, 2**63, 2**64, -(2**63) - 1]), st.integers(-3, 40).map(str))
bools = st.one_of(st.booleans(), st.sampled_from(["true", "1", "no", 2]))
names = st.one_of(st.text(max_size=12), st.sampled_from(["model.norm.weight", "lm_head.weight", ""]))
dtype_names = st.sampled_from(["float32", "bfloat16", "float16", "float8_e4m3fn", "int64", "uint8", "bool",
                               "complex64", "float", "torch.float32", ""])
shapes = st.lists(st.integers(-2, 2**40), max_size=3)


def field_values(name: str, ctx: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values for one field: mostly shaped like the real thing (edge cases included),
    sometimes anything at all."""
    version_like = st.one_of(st.just(ctx["version"]), ints)
    typed: dict[str, st.SearchStrategy[Any]] = {
        "mode": st.sampled_from(["abort", "retract", "in_place", "keep", ""]),
        "selector": st.sampled_from(["all", "target", "draft", "none", ""]),
        "action": st.sampled_from(["snapshot", "reset_tensors", "compare", "checksum", "pre_update", ""]),
        "skip_tensor_list": st.one_of(st.none(), st.lists(names, max_size=3)),
        "model_path": st.sampled_from([ctx["root"], f"{ctx['root']}/missing", f"{ctx['root']}/../..", "/", "",
                                       "/proc/self", "relative/dir", "model_path\x00"]),
        "lora_path": st.sampled_from([ctx["root"], f"{ctx['root']}/../..", "/etc", "", "relative"]),
        "load_format": st.sampled_from([None, "flattened_bucket", "direct", "safetensors", ""]),
        "serialized_named_tensors": st.one_of(pickled_tensors().map(lambda s: [s]), pickled_tensors(),
                                              st.binary(max_size=64).map(lambda b: [base64.b64encode(b).decode()]),
                                              st.lists(st.text(max_size=8), max_size=3)),
        "names": st.lists(names, max_size=4),
        "dtypes": st.lists(dtype_names, max_size=4),
        "shapes": st.lists(shapes, max_size=4),
        "group_name": st.sampled_from(["weight_update_group", "weightsync-x", ""]),
        "backend": st.sampled_from(["gloo", "nccl", "mpi", ""]),
        "world_size": st.one_of(st.integers(-1, 4), ints),
        "master_address": st.just("127.0.0.1"),  # loopback only: nothing listens at master_port
        "master_port": st.sampled_from([ctx["closed_port"], 0, -5, 70000, 2**70, "1"]),
        "manifest": near_valid_manifests(ctx["manifest"]),
        "digest": st.one_of(st.text("0123456789abcdef", min_size=16, max_size=16), st.text(max_size=20)),
        "shm_name": st.sampled_from(["weightsync-0000", "weightsync-" + "a" * 70, "../../etc/passwd", "", "x"]),
        "link": st.one_of(st.fixed_dictionaries({
            "transport": st.sampled_from(["shm", "http", "disk", "broadcast", "nccl", ""]),
            "shm_name": st.sampled_from(["weightsync-0000", "../../etc/passwd", "", "x"]),
            "slot_bytes": ints, "num_slots": ints}), st.dictionaries(st.text(max_size=8), json_values, max_size=3)),
        "delivery": st.one_of(st.fixed_dictionaries({"transport": st.sampled_from(["shm", "http", ""]),
                                                     "slot": st.one_of(ints, json_values)}), json_values),
        "lora_name": names,
        "rid": st.one_of(st.text(max_size=12), ints),
        "tags": st.one_of(st.none(), st.lists(st.sampled_from(["weights", "kv_cache", "cuda_graph", "", "x"]),
                                              max_size=3)),
        "expected_checksums": st.dictionaries(names, st.text(max_size=64), max_size=3),
        "config_dict": st.one_of(json_values, st.fixed_dictionaries({
            "r": ints, "lora_alpha": ints, "target_modules": st.lists(names, max_size=3), "peft_type": st.just("LORA"),
            "use_dora": bools})),
    }
    for key in ("weight_version", "new_version", "version", "weightsync_version"):
        typed[key] = version_like
    for key in ("index", "slot", "slot_bytes", "num_slots", "weightsync_bucket", "rank_offset", "world_size",
                "source_rank", "forward_rank"):
        typed[key] = ints
    for key in ("flush_cache", "abort_all_requests", "pinned", "abort_all", "allow_quant_error"):
        typed[key] = bools
    typed["weightsync_digest"] = typed["digest"]
    strategy = typed.get(name, json_values)
    if name in ("master_address", "master_port"):
        return strategy  # never anything but a closed loopback port
    return st.one_of(strategy, strategy, strategy, json_values)


def near_valid_manifests(manifest: dict[str, Any]) -> st.SearchStrategy[Any]:
    """The model's real manifest with one field replaced by a random value."""
    def mutate(args: tuple[str, Any, int, str, Any]) -> dict[str, Any]:
        top, top_value, bucket_index, entry_key, entry_value = args
        m = json.loads(json.dumps(manifest))
        if top in m:
            m[top] = top_value
        buckets = m.get("buckets")
        if isinstance(buckets, list) and buckets:
            bucket = buckets[bucket_index % len(buckets)]
            if isinstance(bucket, dict) and bucket.get("tensors"):
                bucket["tensors"][0][entry_key] = entry_value
        return m

    keys = st.sampled_from(["version", "mode", "format", "format_version", "digest_algorithm", "base_version",
                            "lora_name", "lora_config", "nothing"])
    entry_keys = st.sampled_from(["hf_name", "dtype", "shape", "offset", "nbytes"])
    return st.tuples(keys, json_values, st.integers(0, 30), entry_keys, json_values).map(mutate)


@st.composite
def bodies(draw: st.DrawFn, route: str, ctx: dict[str, Any]) -> tuple[str, bytes]:
    """(content type, body): a JSON object of the route's fields, any JSON, or raw bytes."""
    kind = draw(st.sampled_from(["fields", "fields", "fields", "any-json", "bytes"]))
    if kind == "bytes":
        return "application/octet-stream", draw(st.binary(max_size=256))
    if kind == "any-json":
        return "application/json", json.dumps(draw(json_values)).encode()
    body = {name: draw(field_values(name, ctx)) for name in FIELDS[route] if draw(st.integers(0, 9)) > 0}
    if route == "/init_weights_update_group":  # reach the rendezvous: a loopback port nobody listens on
        body.update(master_address="127.0.0.1", master_port=ctx["closed_port"], backend="gloo")
    if draw(st.booleans()):
        body.update(draw(st.dictionaries(st.text(max_size=8), json_values, max_size=2)))
    return "application/json", json.dumps(body).encode()


@st.composite
def frames(draw: st.DrawFn, version: int, sizes: list[int]) -> bytes:
    """Bucket frames: random bytes, or the WSB1 layout with a random header and payload."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=512))
    header = {"version": draw(st.one_of(st.just(version), json_values)),
              "index": draw(st.one_of(st.integers(-1, len(sizes) + 1), json_values)),
              "nbytes": draw(st.one_of(st.sampled_from(sizes), st.integers(-1, 1 << 40), json_values)),
              "digest": draw(st.one_of(st.text(max_size=16), json_values))}
    payload = draw(st.binary(max_size=256))
    if draw(st.booleans()):  # a trainer rank's share: often its own digest right, so its range table is parsed
        header["nbytes"] = draw(st.one_of(st.just(len(payload)), st.integers(-1, 300)))
        header["share"] = {"ranges": draw(st.one_of(st.integers(-2, 20), json_values)),
                           "digest": draw(st.one_of(st.just(xxhash.xxh3_64_hexdigest(payload)), json_values))}
    raw = json.dumps({k: v for k, v in header.items() if draw(st.booleans()) or k in ("version", "share")}).encode()
    declared = draw(st.one_of(st.just(len(raw)), st.integers(0, (1 << 32) - 1)))
    return MAGIC + struct.pack("<I", declared) + raw + payload


# -- the runs --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ctx(admin: httpx.Client, keyed_root: Path, fault_model: Path) -> dict[str, Any]:
    import shutil
    import socket

    from weightsync.bucketing import plan_buckets
    from weightsync.dtypes import dtype_from_name
    from weightsync.manifest import Manifest, TensorMeta

    params = admin.get("/weightsync/info").json()["params"]
    metas = [TensorMeta(hf_name=n, dtype=dtype_from_name(p["dtype"]), shape=tuple(p["shape"]))
             for n, p in params.items()]
    version = int(admin.get("/weightsync/info").json()["weight_version"]) + 1
    manifest = Manifest(version=version, mode="full", buckets=plan_buckets(metas, 256 << 10))
    with socket.socket() as s:  # a port nothing listens on (bound, never listening, then closed)
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    restore = keyed_root / "restore"  # the checkpoint, where /update_weights_from_disk may read it
    if not restore.exists():
        shutil.copytree(fault_model, restore)
    return {"manifest": manifest.to_dict(), "root": str(keyed_root), "closed_port": closed_port,
            "sizes": [b.nbytes for b in manifest.buckets], "version": version, "restore": str(restore)}


@pytest.fixture(scope="module")
def initial(admin: httpx.Client) -> dict[str, str]:
    return dict(admin.post("/weightsync/digests", json={}).json()["digests"])


def still_serving(admin: httpx.Client, initial: dict[str, str], restore: str) -> None:
    admin.post("/continue_generation", json={})  # undo a fuzzed pause
    admin.post("/weightsync/abort", json={})  # and a fuzzed session
    admin.post("/resume_memory_occupation", json={})  # and a fuzzed release
    if admin.get("/weightsync/info").json()["torn"]:
        # released or reset weights are gone, as on SGLang; the next update brings them back
        assert admin.post("/update_weights_from_disk", json={"model_path": restore}).status_code == 200
    assert admin.get("/health").status_code == 200
    # greedy and past EOS: an engine that serves answers exactly two tokens (sampled at the default
    # temperature 1, an EOS drawn first ended one answer after one token)
    answer = admin.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {
        "max_new_tokens": 2, "temperature": 0, "ignore_eos": True}})
    assert answer.status_code == 200 and answer.json()["meta_info"]["completion_tokens"] == 2
    assert admin.post("/weightsync/digests", json={}).json()["digests"] == initial, "served weights changed"


def check_answer(route: str, response: httpx.Response) -> None:
    assert response.status_code < 500 or response.status_code in ALLOWED_5XX.get(route, ()), (
        f"{route}: {response.status_code} {response.text[:500]}")
    if response.status_code >= 400:
        body = response.json()
        assert body["success"] is False and isinstance(body["message"], str) and body["message"], body


FUZZED = sorted(set(FIELDS) - {"/weightsync/bucket"})


@pytest.mark.parametrize("session", [False, True], ids=["idle", "in-session"])
@pytest.mark.parametrize("route", FUZZED)
def test_garbled_bodies(route: str, session: bool, admin: httpx.Client, ctx: dict[str, Any],
                        initial: dict[str, str]) -> None:
    """With no update open, and with a weightsync session open (so that session-bound
    checks run: version matches, bucket indices, staging into the session)."""
    examples = 8 if route == "/init_weights_update_group" else EXAMPLES  # each may wait the 1 s group timeout
    if session:
        ctx["version"] = max(ctx["version"], int(admin.get("/weightsync/info").json()["weight_version"]) + 1)
        manifest = {**ctx["manifest"], "version": ctx["version"]}
        assert admin.post("/weightsync/begin", json={"manifest": manifest}).status_code == 200

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(bodies(route, ctx))
    def fuzz(body: tuple[str, bytes]) -> None:
        content_type, content = body
        check_answer(route, admin.post(route, content=content, headers={"Content-Type": content_type}))

    fuzz()
    still_serving(admin, initial, ctx["restore"])


def test_garbled_bucket_frames(admin: httpx.Client, ctx: dict[str, Any], initial: dict[str, str]) -> None:
    version = int(admin.get("/weightsync/info").json()["weight_version"]) + 1
    manifest = {**ctx["manifest"], "version": version}
    assert admin.post("/weightsync/begin", json={"manifest": manifest}).status_code == 200

    @settings(max_examples=80, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(frames(version, ctx["sizes"]))
    def fuzz(frame: bytes) -> None:
        response = admin.post("/weightsync/bucket", content=frame, headers={"Content-Type": "application/octet-stream"})
        check_answer("/weightsync/bucket", response)
        assert response.status_code != 200, "a garbled frame was staged"

    try:
        fuzz()
        assert admin.get("/weightsync/info").json()["session"]["buckets_received"] == []
    finally:
        admin.post("/weightsync/abort", json={"version": version})
    still_serving(admin, initial, ctx["restore"])


def test_values_fuzzing_found_are_refused_cleanly(admin: httpx.Client, ctx: dict[str, Any]) -> None:
    """Regressions: a world_size beyond a C int was a 500 (torch's store raised TypeError);
    a temperature of 1e-300 overflowed the logits and its generation step failed, aborting
    every request stepped with it; a NaN temperature did the same."""
    group = {"master_address": "127.0.0.1", "master_port": ctx["closed_port"], "rank_offset": 1, "backend": "gloo"}
    response = admin.post("/init_weights_update_group", json={**group, "world_size": 2**70})
    assert response.status_code == 400 and "world_size" in response.json()["message"]
    nan = admin.post("/generate", content=b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}')
    assert nan.status_code == 400 and "temperature" in nan.json()["message"]

    def generate(temperature: float) -> dict[str, Any]:
        return dict(admin.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
            "temperature": temperature, "max_new_tokens": 8, "ignore_eos": True}}).json())

    # In one step, as when it failed: queued while generation is paused, admitted together.
    assert admin.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    try:
        with ThreadPoolExecutor(2) as pool:
            answers = [pool.submit(generate, temperature) for temperature in (1e-300, 0.0)]
            wait_until(lambda: admin.get("/weightsync/info").json()["waiting_requests"] == 2, "both to queue")
            assert admin.post("/continue_generation", json={}).status_code == 200
            tiny, greedy = (answer.result() for answer in answers)
    finally:
        admin.post("/continue_generation", json={})
    assert tiny["meta_info"]["finish_reason"]["type"] == "length", tiny
    assert greedy["meta_info"]["finish_reason"]["type"] == "length", greedy
    assert tiny["output_ids"] == greedy["output_ids"]  # below SGLang's epsilon a temperature is greedy
