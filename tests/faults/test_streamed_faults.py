"""Faults in a streamed push (`WeightSync(commit="streamed")`) against a real `weightsync serve`:
a corrupted bucket in the middle, the trainer killed mid-stream, the engine stalled, and a
replica lost in the commit round of two.

A streamed engine has loaded the buckets before the fault into its served weights, so it
cannot keep its last version; what each test proves instead: the push fails within its
bound, the engine then refuses to generate (a request gets the error naming the version it
was loading and the fix, never tokens from a mix; /weightsync/info says so), the next push
goes whole on its own (a delta trainer's too) and lands, and generation resumes with
exactly those weights; with two replicas each is on a version, whole, or refusing.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from serve_check import launch_servers
from weightsync.engines.sglang import SGLangEngine
from weightsync.errors import EngineError, SyncTimeoutError
from weightsync.push.sync import WeightSync
from weightsync_tools import faults
from weightsync_tools.faults import BUCKET_BYTES, DictSource, FaultyTransport, Rig, Weights
from weightsync_tools.faults.inject import ChildTrainer, fail_in_commit_round
from weightsync_tools.faults.rig import digests_of, load_weights, perturbed
from weightsync_tools.faults.scenarios import _child_spec

# fixtures rig, fault_model: tests/support/fault_fixtures.py
pytestmark = pytest.mark.faults

REQUEST = {"input_ids": list(faults.PROMPTS[0]), "sampling_params": {"temperature": 0, "max_new_tokens": 2}}


def _generate(url: str) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=REQUEST, timeout=60)


def _assert_refuses(url: str, version: int) -> str:
    """The engine refuses generation, naming the streamed `version` and the fix; returns the reason."""
    info = httpx.get(f"{url}/weightsync/info", timeout=30).json()
    reason = info["refusing"]
    assert reason is not None and f"streamed update v{version} stopped" in reason, info
    assert "the next full push restores it" in reason
    answer = _generate(url)
    assert answer.status_code == 503 and "refuses to generate" in answer.text, answer.text
    return str(reason)


def _assert_serves(rig: Rig) -> None:
    """The engine serves what the trainer last pushed, bit for bit, and generates with it."""
    assert rig.served() == rig.expected()
    assert rig.info()["refusing"] is None
    assert rig.generates() == rig.version


def _push(rig: Rig, sync: WeightSync, weights: Weights) -> Any:
    version = rig.next_version()
    report = sync.push(DictSource(weights), version=version)
    rig.accept(weights, version)
    return report


def test_a_corrupted_bucket_midway_leaves_the_engine_refusing_until_a_whole_push(rig: Rig) -> None:
    faulty = FaultyTransport(rig.transport("http"), "flip", at_push=2)
    with rig.sync(faulty, mode="delta", commit="streamed") as sync:
        base = rig.weights = rig.new_weights()
        _push(rig, sync, base)  # the version the delta trainer remembers
        version = rig.next_version()
        started = time.monotonic()
        with pytest.raises(EngineError, match="corrupted in transit"):
            sync.push(DictSource(rig.new_weights()), version=version)
        assert time.monotonic() - started < faults.error_bound_s(rig.timeout_s)
        assert faulty.fired.is_set()
        assert "bucket 1: digest" in _assert_refuses(rig.url, version)
        # one tensor changed since the acked version: a delta would send it alone; the engine
        # refuses a delta on its mixed weights (409) and the trainer sends the whole model
        changed = dict(base)
        name = next(iter(changed))
        changed[name] = perturbed({name: base[name]}, seed=77)[name]
        report = _push(rig, sync, changed)
        assert report.verified and report.commit == "streamed" and report.num_tensors == len(base)
        _assert_serves(rig)


def test_a_trainer_killed_mid_stream_leaves_the_engine_refusing(rig: Rig) -> None:
    version, weights = rig.next_version(), rig.new_weights()
    spec = _child_spec(rig, "http", weights, version, fault="block", at_bucket=2, timeout_s=rig.timeout_s,
                       commit="streamed")
    with ChildTrainer(spec) as child:
        assert child.wait_for("READY", faults.CHILD_READY_TIMEOUT_S) is not None, child.tail()
        assert rig.info()["loading"] == version  # buckets 0 and 1 are in the served weights: no step runs
        child.kill()
    # a request waits while the update is open, and is refused once its silent trainer's session is dropped
    answer = _generate(rig.url)
    assert answer.status_code in (200, 503), answer.text
    if answer.status_code == 200:
        finish = answer.json()["meta_info"]["finish_reason"]
        assert finish["type"] == "abort" and "refuses to generate" in finish["message"], finish
    _assert_refuses(rig.url, version)
    with rig.sync("http", commit="streamed") as sync:  # a new trainer takes over
        _push(rig, sync, rig.new_weights())
    _assert_serves(rig)


def test_a_stalled_engine_fails_the_push_within_its_bound_and_refuses_afterwards(rig: Rig) -> None:
    with rig.sync(FaultyTransport(rig.transport("http"), "stop", rig=rig, at_push=2), commit="streamed") as sync:
        _push(rig, sync, rig.new_weights())
        version = rig.next_version()
        started = time.monotonic()
        try:
            with pytest.raises(SyncTimeoutError):
                sync.push(DictSource(rig.new_weights()), version=version)
            assert time.monotonic() - started < faults.error_bound_s(rig.timeout_s)
        finally:
            rig.cont()
        answer = _generate(rig.url)  # the update is aborted, or dropped as silent: never tokens
        assert answer.status_code == 503 or answer.json()["meta_info"]["finish_reason"]["type"] == "abort"
        _assert_refuses(rig.url, version)
        _push(rig, sync, rig.new_weights())
    _assert_serves(rig)


def test_two_replicas_end_each_on_a_whole_version_or_refusing(fault_model: Any) -> None:
    weights = load_weights(fault_model)
    new = perturbed(weights, seed=5)
    with launch_servers(fault_model, 2, args=["--num-threads", "1"]) as servers:
        urls = [s.url for s in servers]

        def lose_the_victim() -> None:  # its update is dropped under it after the witness committed
            httpx.post(f"{urls[1]}/weightsync/abort", json={"version": None}, timeout=30).raise_for_status()

        engines = fail_in_commit_round([SGLangEngine(u) for u in urls], victim=1, witness=0,
                                       on_fire=lose_the_victim)
        with WeightSync(engines, transport="http", bucket_bytes=BUCKET_BYTES, timeout_s=10.0,
                        commit="streamed") as sync:
            with pytest.raises(EngineError) as failed:
                sync.push(DictSource(new), version=1)
            assert any("committed streamed" in note for note in getattr(failed.value, "__notes__", []))
        # the witness serves v1 whole, the victim refuses: neither serves a mix
        witness = httpx.post(f"{urls[0]}/weightsync/digests", json={"names": None}, timeout=30).json()
        assert (witness["weight_version"], witness["digests"]) == (1, digests_of(new))
        assert _generate(urls[0]).status_code == 200
        _assert_refuses(urls[1], 1)
        newer = perturbed(weights, seed=6)
        with WeightSync([SGLangEngine(u) for u in urls], transport="http", bucket_bytes=BUCKET_BYTES,
                        commit="streamed") as sync:
            assert sync.push(DictSource(newer), version=2).verified
        for url in urls:
            served = httpx.post(f"{url}/weightsync/digests", json={"names": None}, timeout=30).json()
            assert (served["weight_version"], served["digests"]) == (2, digests_of(newer))
            assert _generate(url).json()["meta_info"]["finish_reason"]["type"] == "length"
