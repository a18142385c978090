"""The coordinator's own logic against an in-process engine, with failures injected.

`MemoryEngine` (tests/support/memory_engine.py) is an engine whose weights are a
dict: it receives through the real `weightsync.receive.update_session.UpdateSession` (so these
tests run the engines' receiving code too) and only adds failure injection and call
counting; the contract suite (tests/contract) runs the same flows against real servers.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import weightsync as ws
from memory_engine import MemoryEngine
from weightsync.engines.base import EngineCapabilities, EngineUpdate
from weightsync.errors import (
    EngineError,
    IntegrityError,
    ManifestMismatchError,
    SyncTimeoutError,
)
from weightsync.integrity import digest
from weightsync.manifest import Manifest
from weightsync.reports import Ack
from weightsync.transports.broadcast import BroadcastTransport


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.LayerNorm(8))


def engine_for(model: nn.Module, **kw: Any) -> MemoryEngine:
    base = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    return MemoryEngine(base, **kw)


def same(model: nn.Module, engine: MemoryEngine) -> bool:
    return all(torch.equal(engine.weights[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("transport", ["http", "shm", "disk"])
def test_push_reaches_every_engine_verified(transport: str, tmp_path: Path) -> None:
    model = tiny()
    engines = [engine_for(model, label="a"), engine_for(model, label="b")]
    with ws.WeightSync(engines, transport=transport, bucket_bytes=600, disk_root=str(tmp_path)) as sync:
        report = sync.push(model, version=1)
    assert report.verified and report.version == 1
    assert report.num_buckets > 2 and report.num_tensors == 6
    assert report.num_bytes == sum(v.numel() * 4 for v in model.state_dict().values())
    for e in engines:
        assert same(model, e) and e.version == 1
        assert e.calls[:2] == ["capabilities", "connect"] and "abort" not in e.calls
        # staged engines keep generating while bytes stream: paused only around commit
        between = e.calls[e.calls.index("pause:retract") + 1 : e.calls.index("commit")]
        assert between == ["ready"]  # several replicas: one round before any commit
        assert e.calls[-2:] == ["commit", "resume"] or e.calls[-1] == "disconnect"


class RestartedEngine(MemoryEngine):
    """Loses its open update after the bytes are written and before the commit (restarted,
    or its session expired): the engine that would miss the commit."""

    def ready(self, manifest: Manifest, update: EngineUpdate) -> None:
        self.session.abort(manifest.version)
        super().ready(manifest, update)


def test_no_replica_commits_when_one_cannot_over_disk(tmp_path: Path) -> None:
    """Disk moves no byte to an engine before its commit: the round before the commit finds
    the replica that lost its update, and the other one does not commit either."""
    model = tiny()
    good, lost = engine_for(model, label="a"), RestartedEngine(dict(model.state_dict()), label="b")
    with ws.WeightSync([good, lost], transport="disk", disk_root=str(tmp_path), pause="none") as sync:
        before = dict(good.weights)
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        with pytest.raises(EngineError, match="no longer open"):
            sync.push(model, version=1)
        assert "commit" not in good.calls and good.version == 0 and good.weights == before


@pytest.mark.parametrize("transport", ["http", "shm", "disk"])
def test_a_push_hashed_with_the_device_digest_is_verified_on_cpu(transport: str, tmp_path: Path) -> None:
    """wsmix64 forced on CPU buffers: the sender hashes with it, the manifest names it,
    the engine computes it on receipt and acks the same digests."""
    model = tiny()
    engine = engine_for(model)
    begun: list[Manifest] = []
    session_begin = engine.session.begin
    engine.session.begin = lambda m: (begun.append(m), session_begin(m))[1]  # type: ignore[method-assign]
    with ws.WeightSync([engine], transport=transport, bucket_bytes=600, disk_root=str(tmp_path),
                       digest_algorithm="wsmix64") as sync:
        report = sync.push(model, version=1)
    assert report.verified and same(model, engine)
    assert [m.digest_algorithm for m in begun] == ["wsmix64"]
    (ack,) = report.acks
    assert len(ack.digests) == report.num_buckets > 2
    with ws.WeightSync([engine_for(model)], transport=transport, bucket_bytes=600,
                       disk_root=str(tmp_path / "xxh3")) as sync:
        assert sync.push(model, version=1).acks[0].digests != ack.digests, "CPU buffers default to xxh3_64"
    with pytest.raises(ValueError, match="unknown digest_algorithm 'md5'; one of xxh3_64, wsmix64"):
        ws.WeightSync([engine], transport="http", digest_algorithm="md5")


def test_pipeline_overlaps_and_keeps_two_slots() -> None:
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    engine = engine_for(model)
    with ws.WeightSync([engine], transport="shm", bucket_bytes=(64 * 64 + 64) * 4) as sync:
        report = sync.push(model, version=3)
    assert report.num_buckets == 8 and same(model, engine)
    assert report.stages.wire > 0 and report.stages.hash > 0


def test_manifest_mismatch_is_refused_before_any_byte_moves() -> None:
    model = tiny()
    engine = engine_for(model)
    other = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 8), nn.LayerNorm(8))
    with ws.WeightSync([engine], transport="http") as sync, pytest.raises(ManifestMismatchError) as info:
        sync.push(other, version=1)
    assert "0.weight" in info.value.mismatched
    assert not any(c.startswith("receive") for c in engine.calls)
    assert engine.version == 0 and all(not v.any() for v in engine.weights.values())


def test_failure_mid_stream_aborts_resumes_and_the_next_push_works() -> None:
    model = tiny()
    engine = engine_for(model)
    engine.fail_receive_at = 2
    with ws.WeightSync([engine], transport="http", bucket_bytes=600, pause="abort") as sync:
        with pytest.raises(EngineError, match="injected failure at bucket 2"):
            sync.push(model, version=1)
        assert "abort" in engine.calls and engine.version == 0
        assert all(not v.any() for v in engine.weights.values()), "nothing half-applied"
        engine.fail_receive_at = None
        assert sync.push(model, version=2).verified
    assert same(model, engine)


@pytest.mark.parametrize("policy", ["abort", "retract", "in_place"])
def test_a_pause_whose_answer_is_lost_leaves_no_engine_paused(policy: str) -> None:
    model = tiny()
    lost, fine = engine_for(model, label="lost"), engine_for(model, label="fine")
    lost.lose_pause_answer = True
    with ws.WeightSync([fine, lost], transport="http", pause=policy) as sync:
        with pytest.raises(SyncTimeoutError, match="lost: pause"):
            sync.push(model, version=1)
        assert not fine.paused and fine.version == lost.version == 0
        lost.lose_pause_answer = False
        assert sync.push(model, version=2).verified  # after the engine that timed out was cleaned up
    second_begin = [i for i, call in enumerate(lost.calls) if call == "begin"][-1]
    assert {"abort", "resume"} <= set(lost.calls[:second_begin]), "a failed push left an engine paused"
    assert not lost.paused and not fine.paused


def test_hung_engine_becomes_a_timeout() -> None:
    model = tiny()
    engine = engine_for(model)
    engine.hang_receive_at = 0
    try:  # 2 s: only the hung call may run out of it, not a prompt one on a loaded machine
        with ws.WeightSync([engine], transport="http", timeout_s=2.0) as sync:
            t0 = time.monotonic()
            with pytest.raises(SyncTimeoutError, match="receiving bucket 0"):
                sync.push(model, version=1)
            assert time.monotonic() - t0 < 15
    finally:
        engine.unhang.set()
    assert engine.version == 0


def test_an_engine_that_timed_out_is_cleaned_up_in_the_background_before_the_next_push() -> None:
    model = tiny()
    engine = engine_for(model)
    engine.hang_receive_at = 0
    with ws.WeightSync([engine], transport="http", timeout_s=2.0) as sync:
        try:  # the push does not wait on the hung engine again: its abort is owed
            with pytest.raises(SyncTimeoutError, match="receiving bucket 0") as info:
                sync.push(model, version=1)
        finally:
            engine.unhang.set()
        assert any("goes out in the background" in note for note in info.value.__notes__), info.value.__notes__
        engine.hang_receive_at = None
        assert sync.push(model, version=2).verified
    second_begin = [i for i, call in enumerate(engine.calls) if call == "begin"][1]
    assert "abort" in engine.calls[:second_begin], f"the abort went out after the next push began: {engine.calls}"
    assert same(model, engine)


def test_a_pause_that_timed_out_is_resumed_before_the_next_push() -> None:
    """A pause with no answer in time may still land when the engine wakes: it is resumed."""
    model = tiny()
    engine = engine_for(model)
    engine.hang_pause = True
    with ws.WeightSync([engine], transport="http", timeout_s=2.0, pause="abort") as sync:
        try:
            with pytest.raises(SyncTimeoutError, match="pause"):
                sync.push(model, version=1)
        finally:
            engine.unhang.set()
        engine.hang_pause = False
        assert sync.push(model, version=2).verified
    second_begin = [i for i, call in enumerate(engine.calls) if call == "begin"][1]
    assert "resume" in engine.calls[:second_begin], engine.calls
    assert not engine.paused


def test_a_wrong_ack_is_an_integrity_error() -> None:
    model = tiny()
    engine = engine_for(model)
    engine.corrupt_ack = True
    with ws.WeightSync([engine], transport="http") as sync, pytest.raises(IntegrityError, match="digest mismatch"):
        sync.push(model, version=1)


def _moved(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    return model


@pytest.mark.parametrize("transport", ["http", "shm", "disk"])
def test_a_replica_that_fails_its_commit_rolls_back_the_ones_that_committed(transport: str, tmp_path: Path) -> None:
    """All or nothing across replicas: b fails in the commit round after a committed (its
    commit waited for a's), so a is rolled back to v1; the error says so, and v3 lands on both."""
    model = tiny()
    a, b = engine_for(model, label="a", rolls_back=True), engine_for(model, label="b", rolls_back=True)
    a_committed = threading.Event()
    a_commit, b_commit = a.commit, b.commit
    a.commit = lambda m, link: (a_commit(m, link), a_committed.set())[0]  # type: ignore[method-assign]
    b.commit = lambda m, link: (a_committed.wait(10), b_commit(m, link))[1]  # type: ignore[method-assign]
    with ws.WeightSync([a, b], transport=transport, bucket_bytes=600, disk_root=str(tmp_path)) as sync:
        sync.push(model, version=1)
        v1 = dict(a.weights)
        b.fail_commit = True
        with pytest.raises(EngineError, match="injected failure at commit") as info:
            sync.push(_moved(model), version=2)
        assert info.value.__notes__ == ["v2 had committed on a: rolled back to the last version"]
        assert a.version == b.version == 1 and a.weights.keys() == v1.keys()
        assert all(torch.equal(a.weights[k], v1[k]) for k in v1), "a serves v1 again, bit for bit"
        assert a.calls[-3:] == ["abort", "rollback", "resume"]
        b.fail_commit = False
        assert sync.push(model, version=3).verified
    assert same(model, a) and same(model, b) and a.version == b.version == 3


def test_a_wrong_ack_rolls_the_commit_back() -> None:
    """The acks are checked in the commit round: an engine that acked other digests serves its last version."""
    model = tiny()
    engine = engine_for(model, rolls_back=True)
    with ws.WeightSync([engine], transport="http") as sync:
        sync.push(model, version=1)
        v1 = dict(engine.weights)
        engine.corrupt_ack = True
        with pytest.raises(IntegrityError, match="digest mismatch"):
            sync.push(_moved(model), version=2)
    assert engine.version == 1 and all(torch.equal(engine.weights[k], v) for k, v in v1.items())


@pytest.mark.parametrize("failing", ["undoable", "final"])
def test_an_engine_that_cannot_roll_back_commits_last(failing: str) -> None:
    """With one engine that cannot undo a commit, it commits only after every other engine
    acked; its failure rolls the others back, and theirs means it never commits."""
    model = tiny()
    undoable, final = engine_for(model, label="u", rolls_back=True), engine_for(model, label="f")
    with ws.WeightSync([final, undoable], transport="http", bucket_bytes=600) as sync:
        sync.push(model, version=1)
        assert final.calls.count("commit") == undoable.calls.count("commit") == 1
        (undoable if failing == "undoable" else final).fail_commit = True
        with pytest.raises(EngineError, match="injected failure at commit"):
            sync.push(_moved(model), version=2)
    assert final.calls.count("commit") == (1 if failing == "undoable" else 2)
    assert undoable.calls.count("rollback") == 1
    assert undoable.version == final.version == 1
    assert "rollback" not in final.calls


def test_delta_sends_only_changed_tensors_and_falls_back_after_restart() -> None:
    model = tiny()
    engine = engine_for(model)
    with ws.WeightSync([engine], transport="http", mode="delta", bucket_bytes=1 << 20) as sync:
        first = sync.push(model, version=1)
        assert first.mode == "full" and first.num_tensors == 6
        with torch.no_grad():
            model[2].bias.add_(1.0)
        second = sync.push(model, version=2)
        assert second.mode == "delta" and second.num_tensors == 1 and second.num_skipped == 5
        assert second.num_bytes == 8 * 4 and same(model, engine)
        unchanged = sync.push(model, version=3)
        assert unchanged.num_tensors == 0 and engine.version == 3
        engine.version = 0  # the engine restarted from its checkpoint
        with torch.no_grad():
            model[0].weight.mul_(2)
        engine.weights = {k: torch.zeros_like(v) for k, v in engine.weights.items()}
        again = sync.push(model, version=4)
        assert again.num_tensors == 6, "a refused delta falls back to the whole model"
    assert same(model, engine) and engine.version == 4


class FusedEngine(MemoryEngine):
    """Loads layer 0's weight and bias only together (as vLLM loads a fused qkv_proj)."""

    def capabilities(self, timeout_s: float) -> EngineCapabilities:
        return EngineCapabilities(stages_updates=True, fused_groups=(("0.weight", "0.bias"),))


def test_delta_sends_the_whole_fused_group_of_a_changed_tensor() -> None:
    model = tiny()
    engine = FusedEngine({k: torch.zeros_like(v) for k, v in model.state_dict().items()})
    with ws.WeightSync([engine], transport="http", mode="delta", bucket_bytes=1 << 20) as sync:
        sync.push(model, version=1)
        with torch.no_grad():
            model[0].bias.add_(1.0)
            model[2].bias.add_(1.0)
        report = sync.push(model, version=2)
    assert report.mode == "delta" and report.acks[0].loaded_names == {"0.weight", "0.bias", "2.bias"}
    assert same(model, engine)
    caps = EngineCapabilities(fused_groups=(("a", "b"),))
    assert EngineCapabilities.from_dict(caps.to_dict()) == caps


def test_lora_transport_capability_is_checked_up_front() -> None:
    with pytest.raises(ValueError, match=r"cannot take mode='lora' over transport='disk'; it supports \['http'\]"):
        ws.WeightSync([engine_for(tiny())], transport="disk", mode="lora", disk_root="/tmp/x")


def test_digest_of_report_matches_what_engine_holds() -> None:
    model = tiny()
    engine = engine_for(model)
    with ws.WeightSync([engine], transport="http", bucket_bytes=1 << 20) as sync:
        report = sync.push(model, version=5)
    (ack,) = report.acks
    assert ack.digests and all(len(d) == 16 for d in ack.digests)
    assert digest(engine.weights["0.weight"]) == digest(model.state_dict()["0.weight"])


def test_rename_table_maps_checkpoint_names_to_engine_names() -> None:
    model = tiny()
    engine_weights = {("net." + k if k.startswith("2.") else k): torch.zeros_like(v)
                      for k, v in model.state_dict().items()}
    engine = MemoryEngine(engine_weights)
    table = {"2.weight": "net.2.weight", "2.bias": "net.2.bias"}
    with ws.WeightSync([engine], transport="http", rename=table) as sync:
        report = sync.push(model, version=1)
    assert report.verified and {"net.2.weight", "net.2.bias"} <= set(report.acks[0].loaded_names)
    assert torch.equal(engine.weights["net.2.weight"], model.state_dict()["2.weight"])
    with pytest.raises(ws.NamingError, match="match no weight: 'typo'"):
        ws.WeightSync([engine], transport="http", rename={"typo": "x"}).push(model, version=2)


def test_rename_table_holds_for_delta_pushes_that_leave_renamed_tensors_out() -> None:
    """Names are renamed at plan time, for the whole model: a rename entry whose tensor
    did not change (so a delta push leaves it out) is not a stale entry."""
    model = tiny()
    engine_weights = {("net." + k if k.startswith("2.") else k): torch.zeros_like(v)
                      for k, v in model.state_dict().items()}
    engine = MemoryEngine(engine_weights)
    table = {"2.weight": "net.2.weight", "2.bias": "net.2.bias"}
    with ws.WeightSync([engine], transport="http", mode="delta", rename=table) as sync:
        assert sync.push(model, version=1).mode == "full"
        with torch.no_grad():
            model[0].bias.add_(1.0)
        second = sync.push(model, version=2)
        assert second.mode == "delta" and second.num_tensors == 1 and second.verified
        with torch.no_grad():
            model[2].bias.add_(1.0)
        third = sync.push(model, version=3)
        assert third.mode == "delta" and set(third.acks[0].loaded_names) == {"net.2.bias"}
    assert torch.equal(engine.weights["0.bias"], model.state_dict()["0.bias"])
    assert torch.equal(engine.weights["net.2.bias"], model.state_dict()["2.bias"])


def test_an_engine_declaring_other_transports_is_refused_before_any_byte_moves() -> None:
    """What an engine declares at the first push (a stock SGLang: broadcast and disk only)
    is checked before begin, naming the engine and what it takes."""

    class Declaring(MemoryEngine):
        def capabilities(self, timeout_s: float) -> EngineCapabilities:
            return EngineCapabilities(stages_updates=True, transports=frozenset({"broadcast", "disk"}))

    model = tiny()
    engine = Declaring({k: torch.zeros_like(v) for k, v in model.state_dict().items()}, label="stock")
    with ws.WeightSync([engine], transport="http") as sync, \
            pytest.raises(EngineError, match=r"stock: .*over \['broadcast', 'disk'\], not transport='http'"):
        sync.push(model, version=1)
    assert engine.version == 0 and not any(c.startswith(("begin", "receive")) for c in engine.calls)


class SparseMemoryEngine(MemoryEngine):
    """A MemoryEngine that applies sparse updates (declares it, hands out its served tensors)."""

    def __init__(self, weights: dict[str, torch.Tensor], label: str = "sparse") -> None:
        super().__init__(weights, label)
        self.wrong_tensor_ack = False
        """Ack a wrong whole-tensor digest (an engine that applied something else and says so)."""

    def capabilities(self, timeout_s: float) -> EngineCapabilities:
        self.calls.append("capabilities")
        return EngineCapabilities(stages_updates=True, supports_sparse=True)

    def base_tensor(self, hf_name: str) -> torch.Tensor:
        return self.weights[hf_name]

    def commit(self, manifest: Manifest, update: EngineUpdate) -> Ack:
        ack = super().commit(manifest, update)
        if self.wrong_tensor_ack and ack.tensor_digests:
            first = sorted(ack.tensor_digests)[0]
            ack = replace(ack, tensor_digests={**ack.tensor_digests, first: "0" * 16})
        return ack


@pytest.mark.parametrize("snapshot", ["trainer", "host"])
def test_sparse_sends_changed_elements_and_goes_full_when_the_base_is_not_proven(snapshot: str) -> None:
    model = tiny()
    engine = SparseMemoryEngine({k: torch.zeros_like(v) for k, v in model.state_dict().items()})
    with ws.WeightSync([engine], transport="http", mode="sparse", bucket_bytes=1 << 20,
                       sparse_snapshot=snapshot) as sync:
        first = sync.push(model, version=1)
        assert first.mode == "full" and dict(first.encodings) == {"dense": 6} and same(model, engine)
        with torch.no_grad():
            model[0].weight[3, 4] += 1.0
            model[2].bias[1] -= 1.0
        second = sync.push(model, version=2)
        assert second.mode == "sparse" and second.verified and same(model, engine)
        assert second.num_elements == 2 and second.num_tensors == 2 and second.num_skipped == 4
        assert dict(second.encodings) == {"positions16": 2} and second.num_bytes == 2 * 8  # 4+2 bytes, padded to 8
        assert set(second.acks[0].tensor_digests) == {"0.weight", "2.bias"}

        engine.version = 0  # the engine restarted from its checkpoint: not on v2
        engine.weights = {k: torch.zeros_like(v) for k, v in engine.weights.items()}
        with torch.no_grad():
            model[0].weight[0, 0] += 1.0
        again = sync.push(model, version=3)
        assert again.mode == "full" and again.num_tensors == 6 and same(model, engine), "refused: sent whole"

        engine.weights["2.weight"][0, 0] += 5.0  # the engine's v3 drifted from what the trainer holds as v3
        with torch.no_grad():
            model[2].weight[1, 1] += 1.0
        with pytest.raises(IntegrityError, match=r"differ from the trainer's once applied .*2\.weight"):
            sync.push(model, version=4)
        assert engine.version == 3 and not same(model, engine), "the engine keeps its last good version"
        fixed = sync.push(model, version=5)
        assert fixed.mode == "full" and fixed.verified and same(model, engine), "after a failure: whole"
        assert sync.push(model, version=6).mode == "sparse"


def test_a_wrong_whole_tensor_ack_fails_the_push_and_the_next_one_is_full() -> None:
    model = tiny()
    engine = SparseMemoryEngine({k: torch.zeros_like(v) for k, v in model.state_dict().items()})
    with ws.WeightSync([engine], transport="http", mode="sparse") as sync:
        sync.push(model, version=1)
        engine.wrong_tensor_ack = True
        with torch.no_grad():
            model[0].bias[0] += 1.0
        with pytest.raises(IntegrityError, match=r"whole-tensor digest differs from the trainer's .*0\.bias"):
            sync.push(model, version=2)
        engine.wrong_tensor_ack = False
        assert sync.push(model, version=3).mode == "full"


def test_sparse_to_an_engine_that_does_not_apply_it_goes_full() -> None:
    model = tiny()
    engine = engine_for(model)  # declares no supports_sparse
    with ws.WeightSync([engine], transport="http", mode="sparse") as sync:
        sync.push(model, version=1)
        with torch.no_grad():
            model[0].bias[0] += 1.0
        second = sync.push(model, version=2)
    assert second.mode == "full" and second.num_tensors == 6 and same(model, engine)


def test_an_unknown_snapshot_place_is_refused_naming_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"sparse_snapshot must be one of \('trainer', 'host'\), got 'gpu'"):
        ws.WeightSync([engine_for(tiny())], transport="http", mode="sparse", sparse_snapshot="gpu")


def test_a_plan_is_reused_while_the_tensors_stay_the_same() -> None:
    """An RL loop pushes one model step after step: the second push plans nothing new, and a
    push after the model changed (a module swapped for a new one) sends what it holds now."""
    model = tiny()
    engine = engine_for(model)
    with ws.WeightSync([engine], transport="http", bucket_bytes=600) as sync:
        sync.push(model, version=1)
        planned = sync._buckets.last
        with torch.no_grad():
            model[0].weight.mul_(2.0)
        report = sync.push(model, version=2)
        assert report.verified and same(model, engine)
        assert planned is not None and sync._buckets.last is planned
        model[2] = nn.Linear(32, 8)  # new parameters, same names and shapes
        report = sync.push(model, version=3)
        assert report.verified and same(model, engine)
        assert sync._buckets.last is planned  # the same tensors: the same plan
        model[3] = nn.LayerNorm(8).double()  # other dtypes: planned again, and refused by the engine
        with pytest.raises(ManifestMismatchError, match=r"3\.weight: sent \(8,\) torch\.float64"):
            sync.push(model, version=4)
        assert sync._buckets.last is not planned


class PerExpertEngine(MemoryEngine):
    """Declares that it loads Mixture-of-Experts layers one tensor per expert (as vLLM does)."""

    def capabilities(self, timeout_s: float) -> EngineCapabilities:
        return EngineCapabilities(stages_updates=True, expert_layout="per-expert")


class FusedExpertsEngine(MemoryEngine):
    """Declares that it loads fused 3-D experts (as `weightsync serve` does)."""

    def capabilities(self, timeout_s: float) -> EngineCapabilities:
        return EngineCapabilities(stages_updates=True, expert_layout="fused")


def test_replicas_of_both_expert_layouts_take_a_dense_model_and_refuse_an_moe_one() -> None:
    """The layout names only fused experts: a dense model goes to a vLLM-like and a serve-like
    replica in one push; a model with fused experts is refused before any byte moves."""
    from weightsync.tiny import TinyModelConfig, build_model

    model = tiny()
    base = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    engines = [PerExpertEngine(base, label="vllm-like"), FusedExpertsEngine(base, label="serve-like")]
    with ws.WeightSync(engines, transport="http") as sync:
        assert sync.push(model, version=1).verified
    assert all(same(model, e) and e.version == 1 for e in engines)

    moe = build_model(TinyModelConfig(arch="qwen3_moe"))
    held = {k: torch.zeros_like(v) for k, v in moe.state_dict().items()}
    engines = [PerExpertEngine(held, label="vllm-like"), FusedExpertsEngine(held, label="serve-like")]
    with ws.WeightSync(engines, transport="http") as sync, \
            pytest.raises(ValueError, match=r"vllm-like loads per-expert, serve-like loads fused"):
        sync.push(moe, version=1)
    assert all(e.version == 0 and "begin" not in " ".join(e.calls) for e in engines)


class _StockLikeRelayer(MemoryEngine):
    """A client that could relay, of an engine that does not declare `relays` (a stock SGLang)."""

    transports = frozenset({"http", "broadcast"})
    url = "http://127.0.0.1:1"

    def relay(self, *args: Any) -> None:
        raise AssertionError("never called: the engine was refused")

    relay_in_group = wait_relayed = relay_error = relay


def test_a_relay_is_refused_where_it_cannot_run() -> None:
    """fan_out='relay' forwards buckets between engines that relay, over http or broadcast: an
    unknown fan_out, a transport that does not relay (shm: one host; disk: every engine reads the
    directory), a broadcast transport built otherwise than the fan_out says, and an engine client
    that cannot relay are refused when the WeightSync is built, naming the fix; an engine that
    does not declare `relays` (a stock SGLang) before anything moves."""
    engines = [MemoryEngine({}, "a"), MemoryEngine({}, "b")]
    with pytest.raises(ValueError, match="unknown fan_out 'sideways'; one of direct, relay"):
        ws.WeightSync(engines, transport="http", fan_out="sideways")
    for transport in ("shm", "disk"):
        with pytest.raises(ValueError, match=f"transport='{transport}' does not send: use transport='http' or "
                                             "'broadcast'"):
            ws.WeightSync(engines, transport=transport, fan_out="relay", disk_root="/nonexistent")
    with pytest.raises(ValueError, match="a cannot be part of a relay.*use fan_out='direct'"):
        ws.WeightSync(engines, transport="http", fan_out="relay")
    stock = [_StockLikeRelayer({}, "stock")]
    with pytest.raises(ValueError, match=r"needs the transport built to relay.*BroadcastTransport\(relay=True\)"):
        ws.WeightSync(stock, transport=BroadcastTransport(), fan_out="relay")
    with pytest.raises(ValueError, match="built to relay \\(relay=True\\): pass fan_out='relay'"):
        ws.WeightSync(stock, transport=BroadcastTransport(relay=True))
    with pytest.raises(ValueError, match="relay=True forwards buckets between engines over gloo"):
        BroadcastTransport(relay=True, backend="nccl")
    with ws.WeightSync(stock, transport="http", fan_out="relay") as sync, \
            pytest.raises(ws.EngineError, match="no `relays` capability: a stock SGLang cannot relay"):
        sync.push(nn.Linear(2, 2), version=1)
    assert "begin" not in stock[0].calls


def test_shares_are_refused_where_they_cannot_run() -> None:
    """send_shares=True sends each trainer rank's rows of every tensor in http frames of their own,
    digested in wsmix64: another mode, another transport, another digest algorithm and an engine
    client that sends no shares are refused when the WeightSync is built, naming the fix."""
    engines = [MemoryEngine({}, "a")]
    with pytest.raises(ValueError, match="mode='delta' does not: use mode='full'"):
        ws.WeightSync(engines, transport="http", mode="delta", send_shares=True)
    with pytest.raises(ValueError, match="only wsmix64 can: leave digest_algorithm unset"):
        ws.WeightSync(engines, transport="http", send_shares=True, digest_algorithm="xxh3_64")
    with pytest.raises(ValueError, match="transport='shm' does not: use transport='http'"):
        ws.WeightSync(engines, transport="shm", send_shares=True)
    with pytest.raises(ValueError, match="a cannot take buckets in shares .* use send_shares=False"):
        ws.WeightSync(engines, transport="http", send_shares=True)


def test_an_engine_that_does_not_assemble_shares_is_refused_before_any_byte_moves() -> None:
    """An engine client that can send shares, to an engine that declares no `assembles_shares`
    (an older weightsync serve): the first push names it, and nothing is sent."""
    class OldServe(MemoryEngine):
        def receive_share(self, share: Any, forward: Any, *, timeout_s: float) -> None:
            raise AssertionError("a share was sent")

    engine = OldServe({k: torch.zeros_like(v) for k, v in tiny().state_dict().items()}, "old-serve")
    with ws.WeightSync([engine], transport="http", send_shares=True) as sync, \
            pytest.raises(ws.EngineError, match="old-serve.*does not assemble buckets from trainer ranks' shares"):
        sync.push(tiny(), version=1)
    assert engine.version == 0 and "begin" not in " ".join(engine.calls)


class _ExtendedWithoutVerbs(MemoryEngine):
    """A client that hands out its engine's own verbs (`extension()`), of an engine that declares
    it relays and assembles shares, but whose extension has none of those verbs (a client's mistake)."""

    url = "http://127.0.0.1:1"

    def capabilities(self, timeout_s: float) -> EngineCapabilities:
        return replace(super().capabilities(timeout_s), relays=True, assembles_shares=True)

    def extension(self, timeout_s: float) -> object | None:
        return None


@pytest.mark.parametrize(("options", "lacking"), [
    (dict(fan_out="relay"), "`relays`.*no `engines.base.Relayer`.*relay, relay_in_group, wait_relayed and "
                            "relay_error, or use fan_out='direct'"),
    (dict(send_shares=True), "`assembles_shares`.*no `engines.base.ShareReceiver`.*receive_share, or use "
                             "send_shares=False")], ids=["relay", "shares"])
def test_an_engine_declaring_verbs_its_client_lacks_fails_the_push_naming_the_fix(options: dict[str, Any],
                                                                                 lacking: str) -> None:
    """An engine that declares `relays` or `assembles_shares` behind a client whose verbs lack
    them: the push raises `EngineClientError` (shares: carried in the ranks' outcome) naming the
    engine, what is missing and the fix, and the engine keeps serving its version."""
    model = tiny()
    engines = [_ExtendedWithoutVerbs({k: torch.zeros_like(v) for k, v in model.state_dict().items()}, label)
               for label in ("first", "second")]
    with ws.WeightSync(engines, transport="http", **options) as sync, \
            pytest.raises(ws.WeightSyncError, match="first: the engine declares " + lacking):
        sync.push(model, version=1)
    assert all(e.version == 0 for e in engines)


def test_a_streamed_commit_is_refused_at_the_handshake_naming_an_engine_that_cannot_stream() -> None:
    model = tiny()
    engines = [engine_for(model, label="a"), engine_for(model, label="b")]
    refused = pytest.raises(EngineError, match="commit='streamed' needs engines .*a, b cannot: use commit='staged'")
    with ws.WeightSync(engines, transport="http", commit="streamed") as sync, refused:
        sync.push(model, version=1)
    assert all("begin" not in e.calls and e.version == 0 for e in engines)
    with ws.WeightSync(engines, transport="http") as sync:
        assert sync.push(model, version=1).commit == "staged"
