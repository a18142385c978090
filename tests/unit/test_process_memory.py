"""`weightsync.process_memory` and the figures an update session puts in its ack from it:
bytes allocated during an update show in `Ack.peak_extra_bytes`, bytes still held after it in
`Ack.kept_bytes`, and nothing is reported where /proc cannot tell.

The allocations are 64 MiB and more: glibc serves them with mmap (its threshold never grows
past 32 MiB), so they reach the resident set when touched and leave it when freed, and the
resident set moves by their size within the margin below.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from weightsync import process_memory
from weightsync.bucketing import pack, plan_buckets
from weightsync.manifest import Manifest, TensorMeta
from weightsync.process_memory import MemoryMark, host_available_bytes
from weightsync.receive.update_session import OpenUpdate, UpdateSession

MIB = 1 << 20
MARGIN = 8 * MIB
"""What else this process may allocate or free meanwhile (Python objects, the digests)."""

if MemoryMark.take() is None:
    pytest.skip("this machine's /proc cannot reset or read the peak resident set", allow_module_level=True)


def touched(nbytes: int) -> torch.Tensor:
    """`nbytes` of fresh memory, every page written (so resident)."""
    return torch.ones(nbytes, dtype=torch.uint8)


def test_a_mark_sees_a_freed_peak_and_what_is_still_held() -> None:
    mark = MemoryMark.take()
    assert mark is not None
    transient = touched(96 * MIB)
    del transient
    held = touched(64 * MIB)
    figures = mark.since()
    assert figures is not None
    peak, kept = figures
    assert 96 * MIB - MARGIN <= peak <= 96 * MIB + MARGIN, peak / MIB
    assert 64 * MIB - MARGIN <= kept <= 64 * MIB + MARGIN, kept / MIB
    del held


class AllocatingApplier:
    """Serves one weight; its apply keeps `kept_bytes` (what an engine that keeps its previous
    version does), then allocates `transient_bytes` on top and drops them."""

    def __init__(self, *, transient_bytes: int, kept_bytes: int) -> None:
        self.version = 0
        self.transient_bytes, self.kept_bytes = transient_bytes, kept_bytes
        self.kept: list[torch.Tensor] = []

    def not_one_version(self) -> str | None:
        return None

    def expected(self) -> dict[str, TensorMeta]:
        return {"w": TensorMeta(hf_name="w", dtype=torch.float32, shape=(4,))}

    def check_adapter(self, manifest: Manifest) -> None:
        raise AssertionError("no adapters here")

    def apply(self, update: OpenUpdate) -> Sequence[str]:
        self.kept.append(touched(self.kept_bytes))
        transient = touched(self.transient_bytes)
        del transient
        self.version = update.version
        return list(update.tensors)

    def install_adapter(self, update: OpenUpdate) -> None:
        raise AssertionError("no adapters here")

    def release(self, update: OpenUpdate) -> None:
        pass


def one_update(version: int) -> tuple[Manifest, torch.Tensor]:
    weights = {"w": torch.arange(4, dtype=torch.float32)}
    (bucket,) = plan_buckets([TensorMeta.of("w", weights["w"])], 1 << 10)
    buffer = pack(bucket, weights)
    return Manifest(version=version, buckets=[bucket]), buffer


def test_an_update_acks_the_peak_beyond_begin_and_what_it_kept() -> None:
    """The applier keeps 64 MiB, then allocates 96 MiB on top and drops them: the ack says a
    peak of 160 MiB and 64 MiB kept, each within MARGIN."""
    applier = AllocatingApplier(transient_bytes=96 * MIB, kept_bytes=64 * MIB)
    session = UpdateSession(applier, engine="test engine")
    manifest, buffer = one_update(1)
    session.begin(manifest)
    session.stage_bucket(version=1, index=0, buffer=buffer)
    ack = session.commit(1)
    assert ack.peak_extra_bytes is not None and ack.kept_bytes is not None
    assert 160 * MIB - MARGIN <= ack.peak_extra_bytes <= 160 * MIB + MARGIN, ack.peak_extra_bytes / MIB
    assert 64 * MIB - MARGIN <= ack.kept_bytes <= 64 * MIB + MARGIN, ack.kept_bytes / MIB
    assert ack.to_wire()["peak_extra_bytes"] == ack.peak_extra_bytes


def test_without_proc_the_ack_says_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the peak cannot be reset (no /proc, no clear_refs), the ack has no figures, and
    its wire form none either: never a made-up number."""
    monkeypatch.setattr(process_memory, "reset_peak", lambda: False)
    session = UpdateSession(AllocatingApplier(transient_bytes=0, kept_bytes=0), engine="test engine")
    manifest, buffer = one_update(1)
    session.begin(manifest)
    session.stage_bucket(version=1, index=0, buffer=buffer)
    ack = session.commit(1)
    assert ack.peak_extra_bytes is None and ack.kept_bytes is None
    assert "peak_extra_bytes" not in ack.to_wire() and "kept_bytes" not in ack.to_wire()


def test_the_readers_answer_none_for_what_they_cannot_read() -> None:
    assert process_memory.status_bytes("VmRSS", pid=2**31 - 1) is None
    assert process_memory.pss_bytes(2**31 - 1) is None
    assert process_memory.status_bytes("NoSuchField") is None
    assert (process_memory.resident_bytes() or 0) > 0 and (process_memory.peak_resident_bytes() or 0) > 0


def _fake_host(tmp_path: Path, *, allowed: str, online: str = "0-1") -> tuple[str, str]:
    """A /proc and a node directory: 8 GiB available on the host, node 0 with 1 GiB free, node 1 with 2 GiB."""
    proc, nodes = tmp_path / "proc", tmp_path / "node"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       16777216 kB\nMemFree:         1000 kB\n"
                                  "MemAvailable:    8388608 kB\n")
    (proc / "self" / "status").write_text(f"Name:\tpython\nMems_allowed:\t00000003\nMems_allowed_list:\t{allowed}\n")
    for node, free_kib in ((0, 1 << 20), (1, 2 << 20)):
        (nodes / f"node{node}").mkdir(parents=True)
        (nodes / f"node{node}" / "meminfo").write_text(f"Node {node} MemTotal:  8388608 kB\n"
                                                       f"Node {node} MemFree:   {free_kib} kB\n")
    (nodes / "online").write_text(online + "\n")
    return str(proc), str(nodes)


def test_host_available_bytes_is_memavailable_or_the_free_memory_of_the_nodes_the_process_may_use(
        tmp_path: Path) -> None:
    proc, nodes = _fake_host(tmp_path / "a", allowed="0-1")
    assert host_available_bytes(proc=proc, nodes_dir=nodes) == 8 << 30  # every node: the host's figure
    proc, nodes = _fake_host(tmp_path / "b", allowed="1")
    assert host_available_bytes(proc=proc, nodes_dir=nodes) == 2 << 30  # bound to node 1
    proc, nodes = _fake_host(tmp_path / "c", allowed="0", online="0")
    assert host_available_bytes(proc=proc, nodes_dir=nodes) == 8 << 30  # one node online: MemAvailable
    assert host_available_bytes(proc=str(tmp_path / "nowhere"), nodes_dir=nodes) is None  # no /proc: no figure
    real = host_available_bytes()
    assert real is not None and real > 0  # this Linux host's own



def test_inside_heap_given_back_freed_layers_leave_the_resident_set_at_once() -> None:
    """In a fresh interpreter (glibc's thresholds are process-wide, and set for good by the
    call; tests/support/fresh_import.py): once glibc raised its mmap threshold, freed 6-8 MiB
    tensors stay in the heap it keeps (the resident set holds them); inside `heap_given_back`
    each is unmapped as it is freed."""
    from fresh_import import fresh_import

    outside, inside = fresh_import().heap_kept
    assert outside >= 6 * MIB, (outside, inside)  # the case it is for: glibc keeps a freed layer
    assert inside < 2 * MIB, (outside, inside)


def test_trimmed_between_gives_back_what_each_layer_freed_below_memory_in_use() -> None:
    """Pieces under the mmap threshold, freed between pieces still in use, stay resident layer
    after layer (glibc trims a heap's free top only); taken through `trimmed_between`, each
    layer's are given back before the next (a layer frees 0.75-1.6 MiB)."""
    from fresh_import import fresh_import

    plain, trimmed = fresh_import().heap_scattered
    assert plain >= 6 * MIB, (plain, trimmed)  # the case it is for: eight layers' leftovers held (9.5 MiB)
    assert trimmed < 2 * MIB, (plain, trimmed)  # about the layer in hand
