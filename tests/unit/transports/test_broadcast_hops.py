"""The hop header of a relay in a broadcast group (`transports.broadcast.HopHeader`): its
bytes pinned, its round trip, and a relay's stop that fits whatever its message."""

from __future__ import annotations

import pytest
import torch

from weightsync.errors import IntegrityError
from weightsync.transports.broadcast import HOP_HEADER_BYTES, HopHeader

GOLDEN = b'WSR1?\x00\x00\x00{"version":7,"index":2,"nbytes":16,"digest":"00ff00ff00ff00ff"}'


def test_a_hop_header_is_pinned_byte_for_byte() -> None:
    raw = HopHeader(version=7, index=2, nbytes=16, digest="00ff00ff00ff00ff").encode()
    assert raw.dtype == torch.uint8 and raw.numel() == HOP_HEADER_BYTES
    data = raw.numpy().tobytes()
    assert data[: len(GOLDEN)] == GOLDEN and data[len(GOLDEN):] == bytes(HOP_HEADER_BYTES - len(GOLDEN))
    assert HopHeader.decode(raw) == HopHeader(version=7, index=2, nbytes=16, digest="00ff00ff00ff00ff")


def test_a_relays_stop_travels_in_a_header_of_the_same_size() -> None:
    stop = HopHeader(version=3, error="bucket 2 of v3 refused: digest mismatch")
    assert HopHeader.decode(stop.encode()) == stop
    assert HopHeader.decode(HopHeader(version=3, error="x" * 1000).encode()).error == "x" * 300  # cut to fit
    escaped = HopHeader(version=3, error="é\"\\" * 400)  # JSON escapes each to several bytes
    assert HopHeader.decode(escaped.encode()).error == "(message too long to relay)"


def test_bytes_that_are_no_hop_header_are_refused() -> None:
    with pytest.raises(IntegrityError, match="not a relay hop header"):
        HopHeader.decode(torch.zeros(HOP_HEADER_BYTES, dtype=torch.uint8))
    raw = HopHeader(version=1, index=0, nbytes=1, digest="x").encode()
    raw[8] = ord("[")  # JSON, not an object with the fields
    with pytest.raises(IntegrityError, match="malformed relay hop header"):
        HopHeader.decode(raw)
