"""The control channel of one verl update: JSON messages over weightsync's own gloo side group
(the sending actor rank is rank 0, rollout ranks 1..R, as `build_topology` numbers them), and
the verdict board (the group's TCP store) for the actor ranks outside that group.

Nothing crossing a process boundary is unpickled. A gloo group, not a store, carries the records
because a collective fails as soon as a peer's process is gone. Called by
`integrations.verl_update`; the messages: docs/INTEGRATIONS.md ("verl").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from weightsync.errors import SyncTimeoutError
from weightsync.formats.groups import UpdateGroup

REFUSED = 1
"""A rank's status after a bucket it did not take (0: took it)."""


class Channel:
    """The side group as the update's control channel (every call is a collective)."""

    def __init__(self, group: UpdateGroup, *, timeout_s: float) -> None:
        self.group = group
        self.timeout_s = timeout_s

    @property
    def rank(self) -> int:
        return self.group.rank

    def announce(self, message: Mapping[str, Any] | None) -> dict[str, Any]:
        """Rank 0's `message` on every rank (the others pass None)."""
        if self.rank == 0:
            assert message is not None
            payload = json.dumps(message, separators=(",", ":")).encode()
            size = torch.tensor([len(payload)], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.group.broadcast(size, src=0, timeout_s=self.timeout_s)
        data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == 0
                else torch.empty(int(size.item()), dtype=torch.uint8))
        self.group.broadcast(data, src=0, timeout_s=self.timeout_s)
        if self.rank == 0:
            return dict(message)  # type: ignore[arg-type]
        return _json_object(bytes(data.numpy()))

    def took_bucket(self, *, refused: bool) -> bool:
        """This rank's status for the bucket just sent; True when any rank refused it."""
        status = torch.tensor([REFUSED if refused else 0], dtype=torch.int32)
        self.group.all_reduce_max(status, timeout_s=self.timeout_s)
        return int(status.item()) == REFUSED

    def gather_records(self, record: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Every rank's `record`, in rank order, on rank 0; an empty list elsewhere."""
        payload = json.dumps(record, separators=(",", ":")).encode()
        sizes = self.group.all_gather(torch.tensor([len(payload)], dtype=torch.int64), timeout_s=self.timeout_s)
        width = max(int(s.item()) for s in sizes)
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        gathered = self.group.gather(padded, dst=0, timeout_s=self.timeout_s)
        if self.rank != 0:
            return []
        return [_json_object(bytes(data[: int(size.item())].numpy()))
                for data, size in zip(gathered, sizes, strict=True)]


class VerdictBoard:
    """Each update's verdict under a key of the group's TCP store: posted by the sending
    rank, awaited by the actor ranks outside the group (they iterate the weights for the
    gathers and must raise exactly when the sender does)."""

    def __init__(self, store: dist.Store, *, group_name: str) -> None:
        self.store = store
        self.prefix = f"weightsync-verl/{group_name}/verdict"

    @classmethod
    def connect(cls, *, host: str, port: int, group_name: str, timeout_s: float) -> VerdictBoard:
        """A client of the store rank 0 hosts at `host:port`."""
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        return cls(store, group_name=group_name)

    def post(self, seq: int, verdict: Mapping[str, Any]) -> None:
        self.store.set(f"{self.prefix}/{seq}", json.dumps(verdict))

    def wait(self, seq: int, *, timeout_s: float) -> dict[str, Any]:
        """The verdict of update `seq`; SyncTimeoutError when the sending rank posts none in time."""
        key = f"{self.prefix}/{seq}"
        try:
            self.store.wait([key], timedelta(seconds=timeout_s))
        except RuntimeError as e:  # torch raises DistStoreError (a RuntimeError) on timeout or a lost store
            raise SyncTimeoutError(f"no verdict from the sending actor rank (rank 0) for update {seq} within "
                                   f"{timeout_s:.0f}s; did it die? ({e})") from e
        return _json_object(self.store.get(key))


def _json_object(data: bytes) -> dict[str, Any]:
    value = json.loads(data)
    if not isinstance(value, dict):
        raise ValueError(f"a control message is a JSON object, got {type(value).__name__}")
    return value
