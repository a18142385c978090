"""WeightUpdater without HTTP: staged updates change nothing until commit, refused
or aborted ones leave the served weights bit-identical, versions only increase."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from weightsync.bucketing import pack, plan_buckets
from weightsync.errors import IntegrityError, ManifestMismatchError
from weightsync.formats.version_dir import publish, write_bucket, write_manifest
from weightsync.integrity import digest, manifest_names_digest
from weightsync.manifest import Manifest, TensorMeta
from weightsync.reports import Ack
from weightsync.server.errors import ConflictError
from weightsync.server.requests import ServedVersion
from weightsync.server.updates import ENGINE, WeightUpdater


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)
        self.norm = nn.LayerNorm(4)
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))


@pytest.fixture
def model() -> Tiny:
    torch.manual_seed(0)
    return Tiny()


@pytest.fixture
def updater(model: Tiny) -> WeightUpdater:
    lock = threading.RLock()

    @contextlib.contextmanager
    def between_steps() -> Iterator[None]:
        with lock:
            yield

    return WeightUpdater(model, version=3, between_steps=between_steps, session_timeout_s=60)


def new_weights(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=gen).to(p.dtype) for n, p in model.named_parameters()}


def update(
    weights: dict[str, torch.Tensor], version: int, bucket_bytes: int = 64
) -> tuple[Manifest, list[torch.Tensor]]:
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in weights.items()], bucket_bytes)
    buffers = [pack(b, {e.hf_name: weights[e.hf_name] for e in b.entries}) for b in plan]
    return Manifest(version=version, buckets=plan).with_digests([digest(b) for b in buffers]), buffers


def served(updater: WeightUpdater) -> dict[str, str]:
    return updater.weights.digests()[1]


def test_commit_swaps_everything_at_once(updater: WeightUpdater, model: Tiny) -> None:
    weights = new_weights(model, 1)
    manifest, buffers = update(weights, 4)
    before = served(updater)
    updater.begin(manifest.without_digests())
    for bucket, buffer in zip(manifest.buckets, buffers, strict=True):
        assert updater.receive_path.stage(version=4, index=bucket.index, buffer=buffer.clone(),
                                          digest_hex=bucket.digest) == bucket.digest
        assert served(updater) == before and updater.version == 3
    ack = updater.commit(4).without_memory()
    assert ack.to_wire() == {"version": 4, "digests": list(manifest.digests), "loaded_names": sorted(weights)}
    assert served(updater) == {n: digest(t) for n, t in weights.items()}


def write_version_dir(root: Path, manifest: Manifest, buffers: list[torch.Tensor]) -> Path:
    """`manifest`'s version directory under `root`, as the disk transport publishes it."""
    tmp, final = root / f".tmp-v{manifest.version}", root / f"v{manifest.version:08d}"
    tmp.mkdir()
    for bucket, buffer in zip(manifest.buckets, buffers, strict=True):
        write_bucket(tmp, bucket, buffer)
    write_manifest(tmp, manifest)
    publish(tmp, final)
    return final


def test_a_version_directory_is_staged_through_the_receive_path(updater: WeightUpdater, model: Tiny,
                                                                tmp_path: Path) -> None:
    """/update_weights_from_disk into an open session: its manifest.json must be the one begun
    (a field that differs refuses it and aborts the session, weights unchanged); then every
    bucket is staged and committed."""
    weights = new_weights(model, 5)
    manifest, buffers = update(weights, 4)
    directory = write_version_dir(tmp_path, manifest, buffers)
    before = served(updater)
    updater.begin(replace(manifest.without_digests(), timeout_s=30.0))
    with pytest.raises(IntegrityError, match=r"not the manifest begin announced \(differs in timeout_s\)"):
        updater.apply_version_dir(directory, label=None)
    assert updater.session.open_update is None and served(updater) == before
    updater.begin(manifest.without_digests())
    assert updater.apply_version_dir(directory, label="disk").ack.without_memory() == Ack(
        engine=ENGINE, version=4, digests=manifest.digests, loaded_names=frozenset(weights),
        names_digest=manifest_names_digest(manifest.hf_names))
    assert served(updater) == {n: digest(t) for n, t in weights.items()}
    assert updater.weights.served == ServedVersion(4, "disk")


def test_abort_and_refusals_leave_weights_bit_identical(updater: WeightUpdater, model: Tiny) -> None:
    before = served(updater)
    manifest, buffers = update(new_weights(model, 2), 4)
    updater.begin(manifest.without_digests())
    corrupt = buffers[0].clone()
    corrupt[0] ^= 1
    with pytest.raises(IntegrityError, match="digest"):
        updater.receive_path.stage(version=4, index=0, buffer=corrupt, digest_hex=manifest.buckets[0].digest)
    with pytest.raises(IntegrityError, match="truncated"):
        updater.receive_path.stage(version=4, index=0, buffer=buffers[0][:-1].clone(), digest_hex=None)
    updater.receive_path.stage(version=4, index=0, buffer=buffers[0].clone(), digest_hex=None)
    with pytest.raises(IntegrityError, match="never arrived"):
        updater.commit(4)
    assert updater.abort(4) is True and updater.abort(4) is False
    assert served(updater) == before and updater.version == 3


def test_versions_must_increase_and_one_session_at_a_time(updater: WeightUpdater, model: Tiny) -> None:
    weights = new_weights(model, 3)
    with pytest.raises(ConflictError, match="not newer"):
        updater.begin(update(weights, 3)[0])
    updater.begin(update(weights, 5)[0])
    with pytest.raises(ConflictError, match="is held by a trainer that sent no owner") as busy:
        updater.begin(update(weights, 6)[0])
    assert busy.value.retry_after_s is not None and busy.value.retry_after_s > 0
    with pytest.raises(ConflictError, match="not v9"):
        updater.commit(9)


def test_a_session_is_its_owners_until_the_owner_is_gone_or_silent(updater: WeightUpdater, model: Tiny) -> None:
    from dataclasses import replace

    from weightsync.owners import session_owner

    a, b = session_owner(), session_owner()
    manifest = update(new_weights(model, 3), 5)[0]
    updater.begin(replace(manifest, owner=a, timeout_s=30.0))
    with pytest.raises(ConflictError, match=f"held by trainer {a}"):
        updater.begin(replace(manifest, version=6, owner=b, timeout_s=30.0))
    assert updater.abort(5, owner=b) is False, "an abort never drops another trainer's session"
    updater.begin(replace(manifest, version=6, owner=a, timeout_s=30.0))  # its owner begins again
    assert updater.session.open_update is not None and updater.session.open_update.version == 6
    updater.session.open_update.touched -= 31.0  # a's silence, past its own timeout
    assert "past its timeout" in (updater.begin(replace(manifest, version=7, owner=b, timeout_s=30.0)) or "")
    assert updater.session.open_update.owner == b


def test_a_dead_trainers_session_is_reported_gone_however_long_it_was_silent(updater: WeightUpdater,
                                                                            model: Tiny) -> None:
    """The takeover rule decides, not an idle sweep before it: a trainer that died and then
    stayed silent past its timeout is reported as gone (the fault suite's killed-trainer
    test saw "silent" or nothing at all, depending on how slow the machine was)."""
    import os
    import subprocess
    import sys
    from dataclasses import replace

    from weightsync.owners import owner_tag, session_owner

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = owner_tag().rsplit("-", 1)[0] + f"-{child.pid}/dead"
    assert child.pid != os.getpid()
    manifest = update(new_weights(model, 3), 5)[0]
    updater.begin(replace(manifest, owner=dead, timeout_s=3.0))
    assert updater.session.open_update is not None
    updater.session.open_update.touched -= 10 * updater.session_timeout_s  # silent far past both timeouts
    note = updater.begin(replace(manifest, version=6, owner=session_owner(), timeout_s=3.0))
    assert note is not None and "its process is gone" in note, note


def test_idle_session_gives_way_after_the_timeout(updater: WeightUpdater, model: Tiny) -> None:
    weights = new_weights(model, 4)
    updater.begin(update(weights, 5)[0])
    assert updater.session.open_update is not None
    updater.session.open_update.touched -= 2 * updater.session_timeout_s  # idle for twice the timeout
    updater.begin(update(weights, 6)[0])  # the idle v5 session is discarded
    assert updater.session.open_update is not None and updater.session.open_update.version == 6


def test_named_tensors_checked_before_anything_is_copied(updater: WeightUpdater, model: Tiny) -> None:
    before = served(updater)
    good = new_weights(model, 5)
    cases = [
        [("proj.weight", good["proj.weight"]), ("nope.weight", torch.zeros(2))],
        [("proj.weight", good["proj.weight"][:, :-1])],
        [("scale", good["scale"].float())],
        [("proj.weight", good["proj.weight"]), ("proj.weight", good["proj.weight"])],
    ]
    for named in cases:
        with pytest.raises((ManifestMismatchError, ValueError)):
            updater.stage_named(named, label=None)
    assert served(updater) == before and updater.version == 3
    result = updater.stage_named([("proj.weight", good["proj.weight"])], label=None)
    assert result.ack is not None and result.ack.version == 4
    assert served(updater)["proj.weight"] == digest(good["proj.weight"])


def test_sglang_session_applies_at_end_as_the_next_version_under_its_label(updater: WeightUpdater,
                                                                           model: Tiny) -> None:
    good = new_weights(model, 6)
    updater.begin_sglang()
    # slime sends one label on every bucket of an update; SGLang's labels are free strings.
    updater.stage_named([("norm.weight", good["norm.weight"])], label="step_10")
    updater.stage_named([("norm.bias", good["norm.bias"])], label="step_10")
    assert updater.weights.served == ServedVersion(3, "3")
    result = updater.end_sglang()
    assert result.ack is not None and result.ack.version == 4
    assert updater.weights.served == ServedVersion(4, "step_10")
    assert served(updater)["norm.weight"] == digest(good["norm.weight"])
    assert served(updater)["norm.bias"] == digest(good["norm.bias"])


def test_labels_are_sglang_strings_and_versions_stay_weightsync_integers(updater: WeightUpdater,
                                                                         model: Tiny) -> None:
    good = new_weights(model, 8)
    # Applied on arrival: each SGLang-shaped update is the next version; a repeated label is fine.
    for expected in (4, 5):
        updater.stage_named([("norm.bias", good["norm.bias"])], label="v1")
        assert updater.weights.served == ServedVersion(expected, "v1")
    updater.stage_named([("norm.bias", good["norm.bias"])], label=None)  # no label: SGLang keeps it
    assert updater.weights.served == ServedVersion(6, "v1")
    updater.weights.set_label("step_10")  # /update_weight_version: the label only
    assert updater.weights.served == ServedVersion(6, "step_10")
    # weightsync's own pushes still order by integer, whatever the label says.
    with pytest.raises(ConflictError, match="not newer"):
        updater.begin(update(good, 6)[0])
    manifest, buffers = update(good, 7)
    updater.begin(manifest)
    for bucket, buffer in zip(manifest.buckets, buffers, strict=True):
        updater.receive_path.stage(version=7, index=bucket.index, buffer=buffer.clone(), digest_hex=bucket.digest)
    updater.commit(7)
    assert updater.weights.served == ServedVersion(7, "7")


def test_delta_needs_its_base_version(updater: WeightUpdater, model: Tiny) -> None:
    weights = {"norm.bias": new_weights(model, 7)["norm.bias"]}
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in weights.items()], 64)
    with pytest.raises(ConflictError, match="serves v3"):
        updater.begin(Manifest(version=4, mode="delta", buckets=plan, base_version=2))
    updater.begin(Manifest(version=4, mode="delta", buckets=plan, base_version=3))
