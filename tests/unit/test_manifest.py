"""The manifest (`weightsync.manifest`) and the dtype names it carries: JSON round trips, a golden
manifest, malformed input."""

from __future__ import annotations

import json

import pytest
import torch

from weightsync.bucketing import plan_buckets
from weightsync.dtypes import dtype_from_name, dtype_name
from weightsync.errors import ManifestError
from weightsync.manifest import Manifest, TensorMeta

GOLDEN_MANIFEST = (
    '{"base_version":null,"buckets":[{"digest":"0123456789abcdef","index":0,"nbytes":26,'
    '"tensors":[{"dtype":"float32","hf_name":"model.norm.weight","nbytes":16,"offset":0,"shape":[4]},'
    '{"dtype":"bfloat16","hf_name":"lm_head.weight","nbytes":8,"offset":16,"shape":[2,2]},'
    '{"dtype":"bool","hf_name":"mask","nbytes":1,"offset":24,"shape":[]},'
    '{"dtype":"float8_e4m3fn","hf_name":"scale","nbytes":1,"offset":25,"shape":[1]}]}],'
    '"digest_algorithm":"xxh3_64","format":"weightsync.manifest","format_version":1,'
    '"lora_config":null,"lora_name":null,"mode":"full","owner":null,"timeout_s":null,"version":7}'
)


def _golden() -> Manifest:
    metas = [
        TensorMeta(hf_name="model.norm.weight", dtype=torch.float32, shape=(4,)),
        TensorMeta(hf_name="mask", dtype=torch.bool, shape=()),
        TensorMeta(hf_name="lm_head.weight", dtype=torch.bfloat16, shape=(2, 2)),
        TensorMeta(hf_name="scale", dtype=torch.float8_e4m3fn, shape=(1,)),
    ]
    (bucket,) = plan_buckets(metas, 1 << 20)
    return Manifest(version=7, buckets=(bucket.with_digest("0123456789abcdef"),))


def test_golden_manifest_json_is_pinned() -> None:
    assert _golden().to_json() == GOLDEN_MANIFEST


def test_manifest_round_trip() -> None:
    m = Manifest.from_json(GOLDEN_MANIFEST)
    assert m == _golden()
    assert m.to_json() == GOLDEN_MANIFEST
    assert m.num_bytes == 26
    assert m.hf_names == ("model.norm.weight", "lm_head.weight", "mask", "scale")


def test_lora_and_delta_fields_round_trip() -> None:
    base = _golden()
    lora = Manifest(version=3, mode="lora", buckets=base.buckets, lora_config={"r": 8}, lora_name="policy-v3")
    assert Manifest.from_json(lora.to_json()) == lora
    delta = Manifest(version=4, mode="delta", buckets=base.buckets, base_version=3)
    owned = Manifest(version=5, buckets=base.buckets, owner="0123abcd-42/9f", timeout_s=3.0)
    assert Manifest.from_json(owned.to_json()) == owned
    assert Manifest.from_json(delta.to_json()) == delta
    device_hashed = Manifest(version=6, buckets=base.buckets, digest_algorithm="wsmix64")
    assert '"digest_algorithm":"wsmix64"' in device_hashed.to_json()
    assert Manifest.from_json(device_hashed.to_json()) == device_hashed
    # a name this side does not compute still parses: the engine refuses it at begin, naming its own
    assert Manifest.from_json(_mutated(digest_algorithm="blake3")).digest_algorithm == "blake3"


def _mutated(**changes: object) -> str:
    d = json.loads(GOLDEN_MANIFEST)
    for path, value in changes.items():
        target = d
        keys = path.split("__")
        for k in keys[:-1]:
            target = target[int(k)] if k.isdigit() else target[k]
        target[keys[-1]] = value
    return json.dumps(d)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"format": "other"}, "not a weightsync.manifest"),
        ({"version": "7"}, "version must be an integer"),
        ({"mode": "bogus"}, "unknown mode"),
        ({"buckets__0__tensors__0__dtype": "float33"}, "unknown dtype 'float33'"),
        ({"buckets__0__tensors__1__offset": 17}, "'lm_head.weight' at offset 17, expected 16"),
        ({"buckets__0__tensors__0__nbytes": 12}, "nbytes 12 != 16"),
        ({"buckets__0__nbytes": 30}, "nbytes 30 != sum of its tensors 26"),
        ({"buckets__0__index": 3}, "has index 3"),
        ({"mode": "lora"}, "needs a lora_name"),
        ({"mode": "delta"}, "needs the base_version"),
        ({"buckets__0__tensors__1__hf_name": "model.norm.weight"}, "appears twice"),
        ({"digest_algorithm": 64}, "digest_algorithm must be a name such as 'xxh3_64', got 64"),
        ({"digest_algorithm": ""}, "digest_algorithm must be a name"),
    ],
)
def test_malformed_manifest_names_the_offender(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ManifestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Manifest.from_json(_mutated(**changes))


def test_misaligned_offset_is_refused() -> None:
    d = json.loads(GOLDEN_MANIFEST)
    t = d["buckets"][0]["tensors"]
    t[0], t[2] = t[2], t[0]  # the 1-byte bool first: float32 lands at offset 1
    t[0]["offset"], t[1]["offset"], t[2]["offset"] = 0, 1, 9
    with pytest.raises(ManifestError, match="not a multiple of its itemsize|expected"):
        Manifest.from_json(json.dumps(d))


def test_not_json() -> None:
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.from_json(b"\xff{")


def test_dtype_names_are_torch_attribute_names() -> None:
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_from_name("torch.float8_e5m2") is torch.float8_e5m2
    with pytest.raises(ManifestError, match="cannot be synced"):
        dtype_name(torch.qint8)


def test_manifest_json_text_is_json_dumps_of_its_dict_byte_for_byte() -> None:
    """`Manifest.to_json` assembles the buckets' JSON made once per plan; the text is what
    json.dumps of `to_dict()` writes, whatever the names (quotes, non-ASCII) or a lora_config
    holding a "buckets" key, and the begin request carries it unchanged."""
    from weightsync.protocol import BeginRequest

    metas = [TensorMeta(hf_name=f'model.layers.{i}.experts.é"{i}', dtype=(torch.bfloat16, torch.int64)[i % 2],
                        shape=(i % 3, 4)) for i in range(40)]
    plan = plan_buckets(metas, 100)
    manifests = [
        Manifest(version=3, buckets=plan),
        Manifest(version=3, buckets=plan).with_digests(["ab" * 8] * len(plan)),
        Manifest(version=4, mode="lora", buckets=plan, lora_config={"buckets": None, "r": 2}, lora_name="p-v4",
                 owner="trainer", timeout_s=5.0),
        Manifest(version=5, mode="delta", base_version=4),
    ]
    for manifest in manifests:
        text = manifest.to_json()
        assert text == json.dumps(manifest.to_dict(), separators=(",", ":"), sort_keys=True)
        assert Manifest.from_json(text) == manifest
        assert json.loads(BeginRequest(manifest=manifest).to_json_text()) == BeginRequest(manifest=manifest).to_json()


def _many(n: int = 40) -> Manifest:
    metas = [TensorMeta(hf_name=f"model.layers.{i}.w", dtype=torch.float32 if i % 3 else torch.bfloat16,
                        shape=(i % 5 + 1, 3)) for i in range(n)]
    return Manifest(version=3, buckets=tuple(b.with_digest(f"{b.index:016x}") for b in plan_buckets(metas, 200)))


def test_a_known_manifest_is_reused_where_the_json_is_the_same() -> None:
    """An engine parses each begin against the last manifest it began: entries whose JSON is
    the same are the known objects, buckets whose entries all are share their memo, and the
    result equals a parse from scratch (new digests and version included)."""
    known = Manifest.from_dict(json.loads(_many().to_json()))
    again = json.loads(_many().to_json().replace('"version":3', '"version":4'))
    again["buckets"][1]["digest"] = "ffffffffffffffff"
    parsed = Manifest.from_dict(again, known=known)
    assert parsed == Manifest.from_dict(again) and parsed.version == 4
    assert parsed.buckets[1].digest == "ffffffffffffffff"
    for new, old in zip(parsed.buckets, known.buckets, strict=True):
        assert new.memo is old.memo
        assert all(a is b for a, b in zip(new.entries, old.entries, strict=True))


@pytest.mark.parametrize("change", [("shape", [9, 3]), ("dtype", "float16"), ("hf_name", "model.other.w"),
                                    ("offset", 4)])
def test_a_changed_entry_is_parsed_and_checked_again(change: tuple[str, object]) -> None:
    """An entry that differs from the known one in any field is parsed (and refused where
    wrong) as without a known manifest: reuse never skips a check of what changed."""
    known = Manifest.from_dict(json.loads(_many().to_json()))
    raw = json.loads(_many().to_json())
    key, value = change
    raw["buckets"][0]["tensors"][0][key] = value
    try:
        want: Manifest | str = Manifest.from_dict(json.loads(json.dumps(raw)))
    except ManifestError as e:
        want = str(e)
    try:
        got: Manifest | str = Manifest.from_dict(raw, known=known)
    except ManifestError as e:
        got = str(e)
    assert got == want
    if isinstance(got, Manifest):
        assert got.buckets[0].entries[0] is not known.buckets[0].entries[0]
        assert got.buckets[0].memo is not known.buckets[0].memo
        assert got.buckets[1].memo is known.buckets[1].memo


def test_commit_request_golden() -> None:
    """The commit body as engines of earlier releases read it: `names_digest` only when asked."""
    from weightsync.protocol import CommitRequest

    assert CommitRequest(version=3).to_json() == {"version": 3}
    asked = CommitRequest(version=3, pause="retract", names_digest=True)
    assert asked.to_json() == {"version": 3, "pause": "retract", "names_digest": True}
    assert CommitRequest.from_json(asked.to_json()) == asked
    assert CommitRequest.from_json({"version": 3}) == CommitRequest(version=3)
    with pytest.raises(ValueError, match="names_digest"):
        CommitRequest.from_json({"version": 3, "names_digest": "yes"})
