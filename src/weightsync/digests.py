"""The bucket digest algorithms a manifest may name (`xxh3_64`, `wsmix64`), and how each is computed.

Both digest a byte string (whatever dtype holds the bytes) and can be fed tensor by tensor
(`Hasher.update`), giving the digest of the packed bucket. `xxh3_64` runs on the host; `wsmix64` runs
with torch ops where the bytes are, bit-identical on CPU and CUDA. Integrity checks, not MACs. Called
by the pipeline, the transports and every engine; the definitions and what they catch:
docs/PROTOCOL.md ("Digest algorithms").
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import xxhash

XXH3_64 = "xxh3_64"
WSMIX64 = "wsmix64"

MASK64 = (1 << 64) - 1
"""Python ints are unbounded: every 64-bit step of the reference is taken mod 2**64."""
WORD_KEY = 0x9E3779B97F4A7C15
"""Word i is xored with (i + 1) * WORD_KEY (the golden-ratio constant of splitmix64)."""
FMIX_C1 = 0xFF51AFD7ED558CCD
FMIX_C2 = 0xC4CEB9FE1A85EC53
LENGTH_SEED = 0x5753_4D49_5836_3400
"""Mixed with the byte length in the finalisation ("WSMIX64\\0")."""
CHUNK_WORDS = {"cpu": 1 << 17, "other": 1 << 20}
"""Words (8 bytes each) mixed per step: 1 MiB on the host (cache-sized; in numpy's uint64
arithmetic, 1-2 GB/s on this 2-core machine against 0.05-0.1 GB/s for the same int64 torch
ops on the CPU), 8 MiB on a device (fewer kernel launches). Each step holds two 64-bit
temporaries of this size, so memory stays bounded whatever the bucket's size."""


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (no copy).

    Raises ValueError for a non-contiguous tensor: call `.contiguous()` first.
    """
    if not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous tensor: call .contiguous() first")
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    return tensor.reshape(-1).view(torch.uint8)


class Hasher(Protocol):
    """An incremental digest: tensors (any dtype, contiguous or not) fed in order."""

    def update(self, tensor: torch.Tensor) -> Hasher:
        ...

    def hexdigest(self) -> str:
        ...


class Xxh3:
    """xxh3_64 of the bytes fed, on the host (CUDA tensors are copied to host)."""

    name = XXH3_64

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, tensor: torch.Tensor) -> Xxh3:
        if tensor.numel():
            flat = byte_view(tensor.contiguous())
            if flat.device.type != "cpu":
                flat = flat.cpu()
            self._h.update(flat.numpy().data)  # buffer protocol: no copy, GIL released
        return self

    def hexdigest(self) -> str:
        return self._h.hexdigest()


class Wsmix64:
    """wsmix64: a position-keyed sum of mixed 64-bit words, computed where the bytes are.

    The bytes as little-endian 64-bit words w_i (the last zero-padded), n the byte length, fmix64
    MurmurHash3's finaliser, all mod 2**64:

        S      = sum over i of fmix64(w_i ^ ((i + 1) * WORD_KEY))
        digest = fmix64(S ^ fmix64(n ^ LENGTH_SEED))

    int64 torch ops with wrap-around (no float op), so CPU and CUDA agree bit for bit whatever the
    reduction order; `reference_wsmix64` is the same in pure Python. Not a MAC: what it detects and what
    it does not, docs/PROTOCOL.md ("Digest algorithms").
    """

    name = WSMIX64

    def __init__(self) -> None:
        self._sum: torch.Tensor | None = None
        """Running S, a 0-d int64 tensor on the bytes' device (read back once, at the end)."""
        self._nbytes = 0
        self._tail: torch.Tensor | None = None
        """The last 1..7 bytes fed when the byte count is not a multiple of 8."""

    def update(self, tensor: torch.Tensor) -> Wsmix64:
        if not tensor.numel():
            return self
        data = byte_view(tensor.contiguous())
        if self._sum is None:
            self._sum = torch.zeros((), dtype=torch.int64, device=data.device)
        elif data.device != self._sum.device:
            raise ValueError(f"wsmix64: bytes on {data.device} fed to a digest begun on {self._sum.device}; "
                             "feed one device's tensors, or copy them to one device first")
        word_index = self._nbytes // 8
        self._nbytes += data.numel()
        if self._tail is not None:  # complete the pending word first
            need = 8 - self._tail.numel()
            head, data = data[:need], data[need:]
            self._tail = torch.cat([self._tail, head])
            if self._tail.numel() < 8:
                return self
            self._mix(self._tail, word_index)
            self._tail, word_index = None, word_index + 1
        whole = data.numel() // 8 * 8
        if whole:
            self._mix(data[:whole], word_index)
        if whole < data.numel():
            self._tail = data[whole:].clone()
        return self

    def hexdigest(self) -> str:
        total = 0
        if self._sum is not None:
            if self._tail is not None:  # zero-padded last word
                padded = torch.zeros(8, dtype=torch.uint8, device=self._tail.device)
                padded[: self._tail.numel()] = self._tail
                self._mix(padded, self._nbytes // 8)
            total = int(self._sum.item()) & MASK64
        return f"{finalize(total, self._nbytes):016x}"

    def _mix(self, data: torch.Tensor, first_word: int) -> None:
        """Add the terms of `data` (uint8, a multiple of 8 bytes) starting at word `first_word`:
        on the host in numpy (`_mix_host`), elsewhere in torch ops on the device (`_mix_device`)."""
        assert self._sum is not None and data.numel() % 8 == 0
        if data.device.type == "cpu":
            self._sum += _signed(_mix_host(data.numpy(), first_word))
        else:
            self._sum += _mix_device(data, first_word)


def _mix_device(data: torch.Tensor, first_word: int) -> torch.Tensor:
    """The sum (a 0-d int64 tensor, wrapping) of the terms of `data` (uint8, a multiple of 8
    bytes) from word `first_word`, in int64 torch ops where `data` lies, chunk by chunk."""
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    step = CHUNK_WORDS["other"] * 8
    for start in range(0, data.numel(), step):
        chunk = data[start:start + step]
        if chunk.storage_offset() % 8:  # an int64 view needs 8-aligned bytes: copy this chunk
            chunk = chunk.clone()
        words = chunk.view(torch.int64)
        index = first_word + start // 8
        x = torch.arange(index + 1, index + 1 + words.numel(), dtype=torch.int64, device=words.device)
        x.mul_(_signed(WORD_KEY)).bitwise_xor_(words)
        _fmix64_(x, torch.empty_like(x))
        total += x.sum()
    return total


@dataclass(frozen=True)
class Wsmix64Part:
    """wsmix64's terms of one piece of a byte string: what a rank holding that piece
    (an FSDP2 shard) contributes to the digest of the whole (`combine_wsmix64`).

    The sum runs over the words wholly inside the piece; a word the piece shares
    with its neighbours is carried as a partial word instead (the piece's bytes in
    place, zeros elsewhere), since its term needs all of its bytes."""

    total: int
    """Sum mod 2**64 of the terms of the words wholly inside the piece."""
    edges: tuple[tuple[int, int], ...]
    """(word index, partial word) of the at most two words the piece shares."""


def wsmix64_part(tensor: torch.Tensor, byte_offset: int) -> Wsmix64Part:
    """The terms of `tensor`'s bytes, which lie at `byte_offset` of a longer byte string."""
    data = byte_view(tensor.contiguous()) if tensor.numel() else torch.empty(0, dtype=torch.uint8)
    start, end = byte_offset, byte_offset + data.numel()
    first_whole, end_whole = -(-start // 8) * 8, end // 8 * 8
    edges: list[tuple[int, int]] = []
    if start % 8 and start < end:  # the head shares the word of `start`
        head = data[: min(first_whole, end) - start]
        edges.append((start // 8, _partial_word(head, start % 8)))
    total = 0
    if end_whole > first_whole:
        whole = Wsmix64()
        whole._sum = torch.zeros((), dtype=torch.int64, device=data.device)
        whole._mix(data[first_whole - start: end_whole - start], first_whole // 8)
        total = int(whole._sum.item()) & MASK64
    if end % 8 and end_whole >= first_whole:  # the tail shares the word of `end` (not the head's)
        edges.append((end // 8, _partial_word(data[end_whole - start:], 0)))
    return Wsmix64Part(total=total, edges=tuple(edges))


def _partial_word(piece: torch.Tensor, at: int) -> int:
    """The 64-bit little-endian word holding `piece`'s bytes from byte `at`, zeros elsewhere."""
    return int.from_bytes(bytes(piece.cpu().numpy().tobytes()), "little") << (8 * at)


def combine_wsmix64(parts: Iterable[Wsmix64Part], nbytes: int) -> str:
    """wsmix64 of a byte string of `nbytes` from the parts of its pieces (which must
    cover it exactly once): equal to `digest(whole, "wsmix64")`."""
    total = 0
    shared: dict[int, int] = {}
    for part in parts:
        total += part.total
        for index, word in part.edges:
            shared[index] = shared.get(index, 0) | word
    for index, word in shared.items():
        total += fmix64(word ^ (((index + 1) * WORD_KEY) & MASK64))
    return f"{finalize(total & MASK64, nbytes):016x}"


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch takes (two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


_LOW31 = (1 << 31) - 1


def _mix_host(data: np.ndarray[Any, Any], first_word: int) -> int:
    """The sum mod 2**64 of the terms of `data` (uint8, a multiple of 8 bytes) from word
    `first_word`, in numpy's uint64 arithmetic (wrap-around, logical shifts): the same
    terms as `Wsmix64._mix`'s torch ops, bit for bit."""
    words = data.view("<u8") if data.ctypes.data % 8 == 0 else data.copy().view("<u8")
    step = max(1, min(CHUNK_WORDS["cpu"], len(words)))
    x, tmp = np.empty(step, dtype=np.uint64), np.empty(step, dtype=np.uint64)
    key, c1, c2, shift = np.uint64(WORD_KEY), np.uint64(FMIX_C1), np.uint64(FMIX_C2), np.uint64(33)
    total = 0
    with np.errstate(over="ignore"):
        for start in range(0, len(words), step):
            chunk = words[start:start + step]
            xs, ts = x[: len(chunk)], tmp[: len(chunk)]
            xs[:] = np.arange(first_word + start + 1, first_word + start + 1 + len(chunk), dtype=np.uint64)
            xs *= key
            xs ^= chunk
            for multiplier in (c1, c2, None):
                np.right_shift(xs, shift, out=ts)
                xs ^= ts
                if multiplier is not None:
                    xs *= multiplier
            total += int(xs.sum(dtype=np.uint64))
    return total & MASK64


def _fmix64_(x: torch.Tensor, tmp: torch.Tensor) -> None:
    """MurmurHash3's fmix64 of every int64 in `x`, in place. A logical shift right by 33
    is an arithmetic one masked to its low 31 bits (torch shifts int64 arithmetically)."""
    for multiplier in (FMIX_C1, FMIX_C2, None):
        torch.bitwise_right_shift(x, 33, out=tmp)
        tmp.bitwise_and_(_LOW31)
        x.bitwise_xor_(tmp)
        if multiplier is not None:
            x.mul_(_signed(multiplier))


def fmix64(x: int) -> int:
    """MurmurHash3's 64-bit finaliser on a Python int (mod 2**64)."""
    x &= MASK64
    x ^= x >> 33
    x = (x * FMIX_C1) & MASK64
    x ^= x >> 33
    x = (x * FMIX_C2) & MASK64
    return x ^ (x >> 33)


def finalize(total: int, nbytes: int) -> int:
    """wsmix64's last step: the word sum with the byte length mixed in."""
    return fmix64(total ^ fmix64(nbytes ^ LENGTH_SEED))


def reference_wsmix64(data: bytes) -> str:
    """wsmix64 in pure Python, word by word: the definition the torch code must match."""
    padded = data + b"\0" * (-len(data) % 8)
    total = 0
    for i in range(len(padded) // 8):
        word = int.from_bytes(padded[8 * i:8 * i + 8], "little")
        total = (total + fmix64(word ^ (((i + 1) * WORD_KEY) & MASK64))) & MASK64
    return f"{finalize(total, len(data)):016x}"


ALGORITHMS: dict[str, Callable[[], Hasher]] = {XXH3_64: Xxh3, WSMIX64: Wsmix64}
"""Every digest algorithm a manifest may name -> a new incremental hasher."""
COMBINABLE = frozenset({WSMIX64})
"""Algorithms whose digest of a whole tensor combines from digests of its parts (`combine_wsmix64`)."""


def hasher(algorithm: str) -> Hasher:
    """A new incremental hasher for `algorithm`; ValueError naming the known ones otherwise."""
    return ALGORITHMS[require_known(algorithm)]()


def require_known(algorithm: str) -> str:
    """`algorithm` if this side can compute it; ValueError naming the known ones otherwise."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown digest algorithm {algorithm!r}; this side computes {', '.join(ALGORITHMS)}")
    return algorithm


def for_device(device: torch.device | str) -> str:
    """The faster algorithm for buffers on `device`: xxh3_64 on CPU, wsmix64 on an
    accelerator (its bytes never go to host to be hashed)."""
    return XXH3_64 if torch.device(device).type == "cpu" else WSMIX64


def bytes_tensor(data: bytes | bytearray | memoryview) -> torch.Tensor:
    """A uint8 tensor over a bytes-like object's bytes (no copy; never written to)."""
    view = memoryview(data).cast("B")
    if not len(view):
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # read-only buffers warn that writes would fail; none happen
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


FUSED_CHUNK_BYTES = 1 << 20
"""Bytes copied then hashed at a time where a copy and a digest are fused: small enough
to be hashed from the cache the copy left them in (this machine, 64 MiB: copy then
hash 11.0 ms, fused in 1 MiB pieces 9.1 ms; 128 KiB pieces cost more in calls).

Used by engines only. The trainer hashes a bucket whole after packing it: fused
packing re-took the GIL twice per piece on the producer thread and slowed the
thread that moves the bytes (broadcast push, 236 MiB: median 347 ms fused vs
239 ms whole, same run), with no gain for shm (101 vs 101 ms)."""


def copy_hashed(dst: torch.Tensor, src: torch.Tensor, algorithm: str = XXH3_64) -> str:
    """Copy `src` into `dst` (equal-sized 1-d uint8 tensors) and return the digest of the
    bytes written, hashing each piece while it is still in cache: one pass over memory
    where a copy followed by `digest(dst)` makes two."""
    if dst.dtype != torch.uint8 or src.dtype != torch.uint8 or dst.dim() != 1 or dst.shape != src.shape:
        raise ValueError(f"copy_hashed takes equal 1-d uint8 tensors, got {tuple(dst.shape)} {dst.dtype} "
                         f"and {tuple(src.shape)} {src.dtype}")
    h = hasher(algorithm)
    for start in range(0, dst.numel(), FUSED_CHUNK_BYTES):
        piece = dst[start:start + FUSED_CHUNK_BYTES]
        piece.copy_(src[start:start + FUSED_CHUNK_BYTES])
        h.update(piece)
    return h.hexdigest()


def digest(data: torch.Tensor | bytes | bytearray | memoryview, algorithm: str = XXH3_64) -> str:
    """Hex digest of a tensor's bytes (any dtype) or of a bytes-like object."""
    if not isinstance(data, torch.Tensor):
        if algorithm == XXH3_64:
            return xxhash.xxh3_64_hexdigest(data)
        data = bytes_tensor(data)
    return hasher(algorithm).update(data).hexdigest()


__all__ = ["ALGORITHMS", "FUSED_CHUNK_BYTES", "WSMIX64", "XXH3_64", "Hasher", "Wsmix64", "Wsmix64Part", "Xxh3",
           "byte_view", "combine_wsmix64", "copy_hashed", "digest", "for_device", "hasher", "reference_wsmix64",
           "require_known", "wsmix64_part"]
