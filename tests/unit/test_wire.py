"""The HTTP bucket frame: golden bytes and every way a frame can be wrong."""

from __future__ import annotations

import struct

import pytest

from weightsync.errors import IntegrityError
from weightsync.formats.wire import MAGIC, FrameHeader, decode_frame, decode_header, encode_prefix

HEADER = FrameHeader(version=3, index=1, nbytes=4, digest="00000000deadbeef")
GOLDEN = (
    b"WSB1" + struct.pack("<I", 62)
    + b'{"digest":"00000000deadbeef","index":1,"nbytes":4,"version":3}'
)


def test_golden_prefix() -> None:
    assert encode_prefix(HEADER) == GOLDEN


def test_decode_returns_header_and_a_view_of_the_payload() -> None:
    frame = bytearray(GOLDEN + b"\x01\x02\x03\x04")
    header, payload = decode_frame(frame)
    assert header == HEADER
    assert bytes(payload) == b"\x01\x02\x03\x04"
    frame[-1] = 9
    assert payload[-1] == 9  # a view, not a copy


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (b"WSB", "shorter than its 8-byte prefix"),
        (b"XXXX" + GOLDEN[4:] + b"1234", "not a weightsync bucket frame"),
        (MAGIC + struct.pack("<I", 1 << 30), "exceeds"),
        (GOLDEN[:20], "truncated inside its header"),
        (GOLDEN + b"123", "carries 3 payload bytes, header says 4"),
        (GOLDEN + b"12345", "carries 5 payload bytes"),
        (MAGIC + struct.pack("<I", 2) + b"{}", "malformed bucket frame header"),
    ],
)
def test_bad_frames_are_refused(frame: bytes, message: str) -> None:
    with pytest.raises(IntegrityError, match=message):
        decode_frame(frame)


def test_a_relayed_frame_names_the_engines_it_goes_on_to() -> None:
    """`forward` travels in the header only when there is one (an unrelayed frame's header is
    byte for byte what it was), and comes back in order."""
    header = FrameHeader(version=3, index=1, nbytes=2, digest="00ff", forward=("http://b:1", "http://c:2"))
    decoded, payload = decode_frame(encode_prefix(header) + b"xy")
    assert decoded == header and bytes(payload) == b"xy"
    plain = FrameHeader(version=3, index=1, nbytes=2, digest="00ff")
    assert b"forward" not in encode_prefix(plain)


def test_a_header_is_read_from_the_first_bytes_of_a_frame_as_they_arrive() -> None:
    """`decode_header` (the server reads a frame's payload straight into its buffer) needs
    the prefix and the header only, answers None until it has them, and refuses a bad magic
    from the first eight bytes."""
    frame = GOLDEN + b"\x01\x02\x03\x04"
    for cut in (0, 3, 8, len(GOLDEN) - 1):
        assert decode_header(frame[:cut]) is None
    assert decode_header(frame[:len(GOLDEN)]) == (HEADER, len(GOLDEN))
    assert decode_header(frame) == (HEADER, len(GOLDEN))
    with pytest.raises(IntegrityError, match="not a weightsync bucket frame"):
        decode_header(b"XXXX" + GOLDEN[4:8])
