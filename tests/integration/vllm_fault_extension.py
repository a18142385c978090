"""weightsync's vLLM worker extension plus one fault to inject, for tests that need a
fault on ONE rank of a tensor-parallel engine (a worker imports it by name:
`worker_extension_cls="vllm_fault_extension.FaultyDiskExtension"`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from weightsync.engines.vllm_worker import WeightSyncWorkerExtension, _state


class FaultyDiskExtension(WeightSyncWorkerExtension):
    """The product's verbs, unchanged, and `weightsync_test_flip_disk_reads`."""

    def weightsync_test_flip_disk_reads(self, rank: int) -> bool:
        """From now on this worker's disk reads flip one byte of bucket 0 if it is `rank`
        (as a bad read on one host would); any other rank (-1: none) reads as it should.
        True where the fault is on."""
        state = _state(self)
        receiver = state._receiver("disk")
        receiver.__dict__.pop("read", None)  # the class's read again
        if state.rank != rank:
            return False
        original = receiver.read

        def read(link: Any, manifest: Any) -> Iterator[tuple[int, Any]]:
            for index, buffer in original(link, manifest):
                if index == 0:
                    buffer = buffer.clone()
                    buffer[0] ^= 0xFF
                yield index, buffer

        receiver.read = read  # type: ignore[method-assign]
        return True
