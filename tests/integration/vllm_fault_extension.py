"""weightsync's vLLM worker extension plus faults to inject on chosen ranks of a
tensor-parallel engine (a worker imports it by name:
`worker_extension_cls="vllm_fault_extension.FaultyDiskExtension"`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from weightsync.engines.vllm.worker import WeightSyncWorkerExtension, _state, error_payload
from weightsync.errors import ConflictError

REFUSE_COMMIT = "_weightsync_test_refuse_commit"


class FaultyDiskExtension(WeightSyncWorkerExtension):
    """The product's verbs, `weightsync_test_flip_disk_reads`, `weightsync_test_refuse_next_commit`
    and `weightsync_test_pids`."""

    def weightsync_test_pids(self) -> list[int]:
        """[this worker's pid, its parent's] (the memory test reads their /proc)."""
        return [os.getpid(), os.getppid()]

    def weightsync_test_refuse_next_commit(self, ranks: list[int]) -> bool:
        """This worker's next commit refuses, applying nothing (as a worker whose update was
        lost), if its rank is in `ranks`. True where the fault is on."""
        self.__dict__[REFUSE_COMMIT] = _state(self).rank in ranks
        return bool(self.__dict__[REFUSE_COMMIT])

    def weightsync_commit(self, request: str) -> dict[str, Any]:
        if self.__dict__.pop(REFUSE_COMMIT, False):
            error = ConflictError("injected: this rank lost its update before the commit")
            return {"ok": False, "rank": _state(self).rank, "error": error_payload(error)}
        return super().weightsync_commit(request)

    def weightsync_test_flip_disk_reads(self, rank: int) -> bool:
        """From now on this worker's disk reads flip one byte of bucket 0 if it is `rank`
        (as a bad read on one host would); any other rank (-1: none) reads as it should.
        True where the fault is on."""
        state = _state(self)
        receiver = state.receive_path.receiver("disk")
        receiver.__dict__.pop("read", None)  # the class's read again
        if state.rank != rank:
            return False
        original = receiver.read

        def read(link: Any, manifest: Any, *place: Any) -> Iterator[tuple[int, Any]]:
            for index, buffer in original(link, manifest, *place):
                if index == 0:
                    buffer = buffer.clone()
                    buffer[0] ^= 0xFF
                yield index, buffer

        receiver.read = read  # type: ignore[method-assign]
        return True
