"""The transport registry, and WeightSync taking a transport by name or as an object."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fresh_import import fresh_import
from weightsync import SGLangEngine, WeightSync
from weightsync.transports import (
    REGISTRY,
    TRANSPORTS,
    DiskTransport,
    HttpTransport,
    make_transport,
    transport_class,
)
from weightsync.transports.base import Transport


def test_registry_names_match_their_classes() -> None:
    assert tuple(REGISTRY) == TRANSPORTS
    for name in TRANSPORTS:
        assert transport_class(name).name == name  # type: ignore[attr-defined]


def test_unknown_transport_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match=r"unknown transport 'nccl'; valid names: disk, http, broadcast, shm"):
        make_transport("nccl")
    with pytest.raises(ValueError, match="valid names: disk, http, broadcast, shm"):
        WeightSync([SGLangEngine("http://127.0.0.1:9")], transport="nccl")


def test_make_transport_passes_each_class_its_options(tmp_path: Path) -> None:
    disk = make_transport("disk", disk_root=tmp_path, keep_versions=3, timeout_s=5.0)
    assert isinstance(disk, DiskTransport) and disk.root == tmp_path and disk.keep_versions == 3
    assert disk.timeout_s == 5.0
    with pytest.raises(ValueError, match="transport='disk' needs disk_root"):
        make_transport("disk")
    assert isinstance(make_transport("http", disk_root=tmp_path), HttpTransport)  # options it lacks are dropped


def test_transport_modules_load_on_first_use() -> None:
    loaded = [m for m in fresh_import().after_import  # a fresh interpreter's `import weightsync`
              if m.startswith("weightsync.transports.") and m != "weightsync.transports.base"]
    assert not loaded, loaded


def test_weightsync_takes_a_transport_object(tmp_path: Path) -> None:
    engine = SGLangEngine("http://127.0.0.1:9")  # never contacted: nothing is pushed
    transport = DiskTransport(tmp_path / "versions", keep_versions=1)
    assert isinstance(transport, Transport)
    with WeightSync([engine], transport=transport) as sync:
        assert sync.config.transport == "disk"
        assert sync._transport is transport
    with pytest.raises(ValueError, match="disk_root configure a transport made by name"):
        WeightSync([engine], transport=transport, disk_root=str(tmp_path))
    with pytest.raises(TypeError, match="transport must be a name"):
        WeightSync([engine], transport=object())  # type: ignore[arg-type]


def test_each_transport_has_its_own_typed_link_that_round_trips(tmp_path: Path) -> None:
    from weightsync.links import Link
    from weightsync.transports import parse_link
    from weightsync.transports.broadcast import BroadcastLink
    from weightsync.transports.disk import DiskLink
    from weightsync.transports.shm import ShmLink

    links = [Link(transport="http", timeout_s=5.0), DiskLink(transport="disk", root=str(tmp_path)),
             ShmLink(transport="shm", shm_name="weightsync-x", slot_bytes=64, num_slots=2),
             BroadcastLink(transport="broadcast", master_address="127.0.0.1", master_port=1, group_name="g",
                           world_size=2, rank_offset=1, backend="gloo")]
    for link in links:
        again = parse_link(link.to_dict())
        assert again == link and type(again) is type(link)
    assert DiskLink(transport="disk", root="/r").version_dir(7) == "/r/v00000007"
    with pytest.raises(ValueError, match=r"a 'broadcast' link needs \['backend', 'group_name'"):
        parse_link({"transport": "broadcast", "master_address": "h", "master_port": 1, "world_size": 2,
                    "rank_offset": 1})
    with pytest.raises(ValueError, match="unknown transport 'nccl'; valid names: disk, http, broadcast, shm"):
        parse_link({"transport": "nccl"})


def test_gloo_with_buckets_on_a_gpu_is_refused_when_built() -> None:
    """Seen on an H200: a gloo group here broadcasts host tensors only, and a CUDA bucket
    failed at the first broadcast, after the engines had begun. Refused up front, naming
    both fixes (checked by device type: no GPU needed)."""
    from weightsync.transports.broadcast import BroadcastTransport

    with pytest.raises(ValueError, match=r"backend='gloo' broadcasts buckets from host memory, not cuda:0: use "
                                         r"device='cpu' .* or backend='nccl'"):
        BroadcastTransport(device="cuda:0", backend="gloo")
    assert BroadcastTransport().device == torch.device("cpu") and BroadcastTransport().backend == "gloo"
