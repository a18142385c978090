"""weightsync's binary frame for one bucket over HTTP. Pure bytes, no I/O.

    offset 0   4 bytes  magic b"WSB1"
    offset 4   4 bytes  header length N, uint32 little-endian
    offset 8   N bytes  header: UTF-8 JSON {"version", "index", "nbytes", "digest"}; in a
                        relayed push, "forward": the engines the bucket goes on to, in order;
                        for one trainer rank's share of the bucket, "share": {"ranges",
                        "digest"} (`weightsync.formats.shares`: "digest" is then the whole bucket's)
    offset 8+N          the packed bucket (or the share), exactly `nbytes` raw bytes

No base64, no pickle: the payload is the bucket buffer as it sits in memory,
and the receiver checks its length and digest against the header (and the
header against the manifest sent at begin) before using a byte.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from weightsync.errors import IntegrityError

MAGIC = b"WSB1"
MAX_HEADER_BYTES = 64 << 10
_PREFIX = struct.Struct("<4sI")


@dataclass(frozen=True, kw_only=True)
class FrameHeader:
    """The JSON header of a bucket frame."""

    version: int
    """Weight version the bucket belongs to."""
    index: int
    """Bucket index in the manifest."""
    nbytes: int
    """Payload length in bytes."""
    digest: str
    """The payload's hex digest, in the manifest's digest algorithm."""
    forward: tuple[str, ...] = ()
    """A relayed push (`fan_out="relay"`): the URLs of the engines this bucket goes on to,
    in order; the receiving engine checks it, stages it, then sends it to the first of them
    with the rest (`weightsync.server.relay`)."""

    share_ranges: int = 0
    """A share (`weightsync.formats.shares`): the payload is one trainer rank's ranges of the bucket,
    after a table of this many (offset, length) pairs; `nbytes` is the payload's length and
    `digest` the WHOLE bucket's. 0: the payload is the whole bucket."""
    share_digest: str | None = None
    """A share's own digest, over its payload (`shares.SHARE_DIGEST`)."""

    @property
    def is_share(self) -> bool:
        return self.share_ranges > 0

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"version": self.version, "index": self.index, "nbytes": self.nbytes,
                             "digest": self.digest}
        if self.forward:
            d["forward"] = list(self.forward)
        if self.is_share:
            d["share"] = {"ranges": self.share_ranges, "digest": self.share_digest}
        return d


def encode_prefix(header: FrameHeader) -> bytes:
    """Magic, header length and header; the payload follows as-is."""
    body = json.dumps(header.to_dict(), separators=(",", ":"), sort_keys=True).encode()
    return _PREFIX.pack(MAGIC, len(body)) + body


def decode_header(data: bytes | bytearray | memoryview) -> tuple[FrameHeader, int] | None:
    """The header of a frame that begins with `data`, and the offset its payload starts at;
    None while `data` ends inside the prefix or the header (more bytes are needed).

    Raises IntegrityError for a wrong magic or an oversized or malformed header.
    """
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX.size:
        return None
    magic, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise IntegrityError(f"not a weightsync bucket frame (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if header_len > MAX_HEADER_BYTES:
        raise IntegrityError(f"bucket frame header of {header_len} bytes exceeds {MAX_HEADER_BYTES}")
    end = _PREFIX.size + header_len
    if len(view) < end:
        return None
    try:
        raw = json.loads(bytes(view[_PREFIX.size:end]))
        share = raw.get("share") or {}
        header = FrameHeader(
            version=int(raw["version"]), index=int(raw["index"]),
            nbytes=int(raw["nbytes"]), digest=str(raw["digest"]),
            forward=tuple(str(url) for url in raw.get("forward") or ()),
            share_ranges=int(share.get("ranges", 0)),
            share_digest=str(share["digest"]) if share else None,
        )
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise IntegrityError(f"malformed bucket frame header: {e}") from None
    if header.nbytes < 0:
        raise IntegrityError(f"malformed bucket frame header: nbytes {header.nbytes} is negative")
    return header, end


def check_payload_length(header: FrameHeader, received: int) -> None:
    """IntegrityError unless a frame carried exactly the `nbytes` its header declares."""
    if received != header.nbytes:
        raise IntegrityError(
            f"bucket {header.index}: frame carries {received} payload bytes, "
            f"header says {header.nbytes} (truncated?)"
        )


def decode_frame(frame: bytes | bytearray | memoryview) -> tuple[FrameHeader, memoryview]:
    """Split a whole frame into its header and a view of its payload (no copy).

    Raises IntegrityError for a wrong magic, an oversized or malformed header, a frame
    that ends inside its header, or a payload whose length differs from the header's `nbytes`.
    """
    view = memoryview(frame).cast("B")
    decoded = decode_header(view)
    if decoded is None:
        if len(view) < _PREFIX.size:
            raise IntegrityError(f"bucket frame of {len(view)} bytes is shorter than its {_PREFIX.size}-byte prefix")
        raise IntegrityError("bucket frame truncated inside its header")
    header, end = decoded
    payload = view[end:]
    check_payload_length(header, len(payload))
    return header, payload


BODY_PIECE_BYTES = 1 << 20
"""Largest piece of a request body handed to httpx at once. h11 copies each piece
into a new bytes object and httpcore re-slices that bytes object after every
partial socket send, which is quadratic in the piece size: one 256 MiB piece
took seconds; 1 MiB pieces keep it linear."""


def body_chunks(*parts: bytes | memoryview) -> Iterator[bytes]:
    """Request body parts in pieces of at most BODY_PIECE_BYTES, sent without
    concatenating (httpx streams an iterator)."""
    for part in parts:
        view = memoryview(part)
        for start in range(0, len(view), BODY_PIECE_BYTES):
            yield view[start : start + BODY_PIECE_BYTES]  # type: ignore[misc]
