"""The manifest: what an update holds, sent and checked before a byte moves. One
`TensorMeta` per tensor the trainer sends, its place in a bucket (`TensorEntry`), the
buckets (`BucketMeta`), and the `Manifest` with the modes it may carry; its JSON form is
pinned in docs/PROTOCOL.md.

Everything here is a frozen dataclass with a JSON form. Nothing here does I/O or touches
tensor data; dtypes travel by name (`weightsync.dtypes`), and how a tensor's bytes sit in
its bucket, and how many there are, is `weightsync.change_encoding`'s.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, Literal, TypeVar, overload

import torch

from weightsync.change_encoding import ENCODINGS, encoded_nbytes
from weightsync.dtypes import dtype_from_name, dtype_name
from weightsync.errors import ManifestError

R = TypeVar("R")


class computed_once(Generic[R]):  # lower case: a decorator, like functools.cached_property
    """A property computed on first read and kept in the instance's `__dict__`: for values
    derived from frozen fields (a bucket's byte size). Unlike `functools.cached_property`
    it takes no lock (Python 3.11 takes one per first read, a few microseconds, which
    tens of thousands of manifest entries feel); two threads reading at once both compute
    the same value."""

    def __init__(self, func: Callable[[Any], R]) -> None:
        self.func = func
        self.name = func.__name__
        self.__doc__ = func.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> computed_once[R]: ...

    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> R: ...

    def __get__(self, obj: object | None, objtype: type | None = None) -> R | computed_once[R]:
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.func(obj)
        return value


Mode = Literal["full", "lora", "lora-merged", "delta", "sparse"]
MODES: tuple[str, ...] = ("full", "lora", "lora-merged", "delta", "sparse")
PARTIAL_MODES = frozenset({"delta", "sparse"})
"""Modes whose manifest applies on top of a `base_version` and may leave tensors out."""
COMMITS: tuple[str, ...] = ("staged", "streamed")
"""How an engine commits an update (`Manifest.commit`; docs/GUARANTEES.md has the promise of each)."""

MANIFEST_FORMAT = "weightsync.manifest"
MANIFEST_FORMAT_VERSION = 1
DIGEST_ALGORITHM = "xxh3_64"
"""The default digest algorithm; `weightsync.digests.ALGORITHMS` holds every known one."""


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_encoding(hf_name: str, encoding: str, num_changed: int, numel: int) -> None:
    if encoding not in ENCODINGS:
        raise ManifestError(f"tensor {hf_name!r}: unknown encoding {encoding!r}; one of {ENCODINGS}")
    if encoding == "dense" and num_changed:
        raise ManifestError(f"tensor {hf_name!r}: a dense entry carries no num_changed")
    if not 0 <= num_changed <= numel:
        raise ManifestError(f"tensor {hf_name!r}: num_changed {num_changed} outside [0, {numel}]")


@dataclass(frozen=True, kw_only=True)
class TensorMeta:
    """What an engine must know about one tensor before its bytes arrive."""

    hf_name: str
    """Hugging Face checkpoint name, e.g. "model.layers.0.mlp.up_proj.weight"."""
    dtype: torch.dtype
    """Element type; sent as its torch attribute name."""
    shape: tuple[int, ...]
    """Full (unsharded) shape."""
    encoding: str = "dense"
    """How its bytes travel (`ENCODINGS`); not "dense" only in "sparse" manifests."""
    num_changed: int = 0
    """Sparse encodings: the changed elements carried (0 for "dense")."""
    tensor_digest: str | None = None
    """"sparse" manifests: digest of the whole tensor the engine must hold once the
    update is applied (the manifest's digest algorithm)."""

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    @computed_once
    def nbytes(self) -> int:
        """Bytes in its bucket: the whole tensor, or its sparse payload."""
        return encoded_nbytes(self.encoding, _numel(self.shape), self.dtype.itemsize, self.num_changed)

    @classmethod
    def of(cls, hf_name: str, tensor: torch.Tensor) -> TensorMeta:
        return cls(hf_name=hf_name, dtype=tensor.dtype, shape=tuple(tensor.shape))


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    """One tensor's place inside a bucket's flat byte buffer."""

    hf_name: str
    """Hugging Face checkpoint name (or PEFT name in lora mode)."""
    dtype: torch.dtype
    """Element type."""
    shape: tuple[int, ...]
    """Full shape."""
    offset: int
    """Byte offset inside the bucket; a multiple of the dtype's itemsize."""
    encoding: str = "dense"
    """How its bytes sit in the bucket (`ENCODINGS`)."""
    num_changed: int = 0
    """Sparse encodings: the changed elements carried."""
    tensor_digest: str | None = None
    """"sparse" manifests: digest of the whole tensor once applied."""

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    @computed_once
    def nbytes(self) -> int:
        """Bytes in the bucket: the whole tensor, or its sparse payload."""
        return encoded_nbytes(self.encoding, _numel(self.shape), self.dtype.itemsize, self.num_changed)

    @property
    def is_dense(self) -> bool:
        return self.encoding == "dense"

    @property
    def stored_dtype(self) -> torch.dtype:
        """The dtype its bytes are described with to readers that know no encodings (a
        safetensors header, SGLang's broadcast request): uint8 for a sparse payload."""
        return self.dtype if self.is_dense else torch.uint8

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape its bytes are described with (see `stored_dtype`): (nbytes,) for a payload."""
        return self.shape if self.is_dense else (self.nbytes,)

    @property
    def meta(self) -> TensorMeta:
        return TensorMeta(hf_name=self.hf_name, dtype=self.dtype, shape=self.shape, encoding=self.encoding,
                          num_changed=self.num_changed, tensor_digest=self.tensor_digest)

    def to_dict(self) -> dict[str, Any]:
        return {**self._wire, "shape": list(self.shape)}

    @computed_once
    def _wire(self) -> dict[str, Any]:
        """`to_dict`, made once per entry (a plan reused across pushes sends the same entries)."""
        d: dict[str, Any] = {
            "hf_name": self.hf_name,
            "dtype": dtype_name(self.dtype),
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
        }
        if not self.is_dense:  # dense entries keep the format they always had
            d["encoding"] = self.encoding
            d["num_changed"] = self.num_changed
        if self.tensor_digest is not None:
            d["tensor_digest"] = self.tensor_digest
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TensorEntry:
        try:
            hf_name = d["hf_name"]
            shape = tuple(map(int, d["shape"]))
            dtype = dtype_from_name(str(d["dtype"]))
            offset = int(d["offset"])
            encoding = str(d.get("encoding", "dense"))
            num_changed = int(d.get("num_changed", 0))
            nbytes = int(d["nbytes"])
            tensor_digest = d.get("tensor_digest")
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ManifestError):
                raise
            raise ManifestError(f"malformed tensor entry {dict(d)!r}: {e}") from None
        if tensor_digest is not None and not isinstance(tensor_digest, str):
            raise ManifestError(f"tensor {hf_name!r}: tensor_digest must be a hex string or null")
        if (shape and min(shape) < 0) or offset < 0:
            raise ManifestError(f"tensor {hf_name!r}: negative shape or offset")
        hf_name, numel = str(hf_name), _numel(shape)
        _check_encoding(hf_name, encoding, num_changed, numel)
        implied = encoded_nbytes(encoding, numel, dtype.itemsize, num_changed)
        if nbytes != implied:
            raise ManifestError(f"tensor {hf_name!r}: nbytes {nbytes} != {implied} implied by shape and dtype")
        # Every field checked: filled in directly, as the frozen __init__ would (it costs more
        # than the rest of this parse, and a manifest has one entry per checkpoint tensor).
        entry = object.__new__(cls)
        entry.__dict__.update(hf_name=hf_name, dtype=dtype, shape=shape, offset=offset, encoding=encoding,
                              num_changed=num_changed, tensor_digest=tensor_digest, nbytes=implied)
        return entry


@dataclass(frozen=True, kw_only=True)
class BucketMeta:
    """A bucket: tensors packed back to back into one flat uint8 buffer.

    The layout is SGLang's "flattened_bucket": no padding, tensors in `entries`
    order, descending itemsize so every offset is aligned to its dtype.
    """

    index: int
    """Position of the bucket in the manifest, from 0."""
    entries: tuple[TensorEntry, ...]
    """The tensors, in buffer order."""
    digest: str | None = None
    """xxh3_64 hex digest of the packed bytes, once known."""

    @computed_once
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @computed_once
    def memo(self) -> dict[str, Any]:
        """Values derived from this bucket's entries, made once and shared with every copy of
        it that differs in its digest only (`with_digest`, and `from_dict` reusing a known
        bucket): its entries' JSON, their names, its staging plan (`bucketing.bucket_views`).
        A plan reused push after push derives them once."""
        return {}

    @property
    def hf_names(self) -> tuple[str, ...]:
        names: tuple[str, ...] | None = self.memo.get("hf_names")
        if names is None:
            names = self.memo["hf_names"] = tuple(e.hf_name for e in self.entries)
        return names

    def with_digest(self, digest: str | None) -> BucketMeta:
        bucket = replace(self, digest=digest)
        bucket.__dict__["nbytes"] = self.nbytes
        bucket.__dict__["memo"] = self.memo  # the same entries: one memo for both
        return bucket

    def to_json(self) -> str:
        """`to_dict` as JSON text (sorted keys, no spaces), its entries' part made once per
        plan (`memo`): a push of tens of thousands of tensors builds no dict per tensor."""
        return (f'{{"digest":{json.dumps(self.digest)},"index":{self.index},"nbytes":{self.nbytes},'
                f'"tensors":{self._entries_json()}}}')

    def _entries_json(self) -> str:
        entries_json: str | None = self.memo.get("json")
        if entries_json is None:
            entries_json = self.memo["json"] = json.dumps([e.to_dict() for e in self.entries],
                                                          separators=(",", ":"), sort_keys=True)
        return entries_json

    @property
    def layout_digest(self) -> str:
        """SHA-256 (hex) of everything but the digest: the index, the size, the entries' JSON
        (`to_dict`: names, dtypes, shapes, offsets, encodings). Made once per plan (`memo`)."""
        layout: str | None = self.memo.get("layout_digest")
        if layout is None:
            text = f"{self.index}:{self.nbytes}:{self._entries_json()}"
            layout = self.memo["layout_digest"] = hashlib.sha256(text.encode()).hexdigest()
        return layout

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "nbytes": self.nbytes,
            "digest": self.digest,
            "tensors": [e.to_dict() for e in self.entries],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, known: BucketMeta | None = None) -> BucketMeta:
        """Parse and check a bucket's JSON form. `known`: a bucket parsed before (the last
        update's at the same index); an entry whose JSON equals its entry at the same place
        (`TensorEntry.to_dict`) parses to that entry, so it is reused instead of parsed
        again, and a bucket whose every entry is reused is `known` with this digest."""
        try:
            index = int(d["index"])
            raw = d["tensors"]
            if known is not None and index == known.index and isinstance(raw, list) \
                    and len(raw) == len(known.entries):
                entries = tuple(k if r == k._wire else TensorEntry.from_dict(r)
                                for r, k in zip(raw, known.entries, strict=True))
            else:
                known = None
                entries = tuple(TensorEntry.from_dict(t) for t in raw)
            nbytes = int(d["nbytes"])
            digest = d.get("digest")
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ManifestError):
                raise
            raise ManifestError(f"malformed bucket: {e}") from None
        if digest is not None and not isinstance(digest, str):
            raise ManifestError(f"bucket {index}: digest must be a hex string or null")
        if known is not None and all(a is b for a, b in zip(entries, known.entries, strict=True)):
            bucket = known.with_digest(digest)
        else:
            bucket = cls(index=index, entries=entries, digest=digest)
        if not bucket.memo.get("layout_checked"):
            _check_layout(bucket)
            bucket.memo["layout_checked"] = True
        if nbytes != bucket.nbytes:
            raise ManifestError(f"bucket {index}: nbytes {nbytes} != sum of its tensors {bucket.nbytes}")
        return bucket


def _check_layout(bucket: BucketMeta) -> None:
    """Offsets must be back to back from 0 and aligned to each tensor's itemsize."""
    expected = 0
    for e in bucket.entries:
        if e.offset != expected:
            raise ManifestError(
                f"bucket {bucket.index}: tensor {e.hf_name!r} at offset {e.offset}, "
                f"expected {expected} (tensors must be back to back, no padding)"
            )
        if e.offset % e.dtype.itemsize:
            raise ManifestError(
                f"bucket {bucket.index}: tensor {e.hf_name!r} offset {e.offset} is not a multiple "
                f"of its itemsize {e.dtype.itemsize}; order tensors by descending itemsize"
            )
        expected += e.nbytes


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Everything an engine needs to check and place an update before bytes move."""

    version: int
    """The weight version this update produces."""
    mode: str = "full"
    """What is sent: "full", "lora", "lora-merged", "delta" or "sparse"."""
    buckets: tuple[BucketMeta, ...] = ()
    """The buckets in send order."""
    lora_config: Mapping[str, Any] | None = None
    """adapter_config.json contents, in "lora" mode."""
    lora_name: str | None = None
    """The adapter name the engine loads a "lora" update under, e.g. "policy-v7"."""
    base_version: int | None = None
    """"delta" and "sparse" modes: the version the engine must be serving for the update
    to apply."""
    owner: str | None = None
    """The trainer sending this update (`owners.session_owner()`): engines keep one
    owner's session from being taken by another while that owner is alive."""
    timeout_s: float | None = None
    """The owner's push timeout: an engine may discard the session, and let another
    trainer begin, once the owner has been silent this long."""
    digest_algorithm: str = DIGEST_ALGORITHM
    """How every bucket digest is computed (`weightsync.digests.ALGORITHMS`): "xxh3_64"
    or "wsmix64". An engine refuses, at begin, one it does not compute."""
    commit: str = "staged"
    """How the engine commits (`COMMITS`): "staged", the whole update staged and swapped in
    at the commit (all or nothing); "streamed", each bucket loaded into the served weights
    once its digest checks and let go, generation held from begin to commit (never a mix:
    a failure midway leaves the engine refusing generation until a full push lands). On the
    wire only when "streamed" (absent: "staged")."""

    @property
    def num_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def is_adapter(self) -> bool:
        """The update is a LoRA adapter, loaded by name next to the base weights (not into them)."""
        return self.mode == "lora"

    @property
    def hf_names(self) -> tuple[str, ...]:
        return tuple(n for b in self.buckets for n in b.hf_names)

    def entries(self) -> Iterator[TensorEntry]:
        for b in self.buckets:
            yield from b.entries

    @property
    def digests(self) -> tuple[str | None, ...]:
        return tuple(b.digest for b in self.buckets)

    @property
    def layout_digest(self) -> str:
        """SHA-256 (hex) of the buckets' layouts (`BucketMeta.layout_digest`, in order): what
        is sent, where, in what dtype and shape; not the version, mode, owner or digests. Two
        manifests of one plan have the same; an engine that remembers a layout by it takes a
        begin that names it instead of the buckets (`protocol.BeginRequest.by_layout`)."""
        return hashlib.sha256(",".join(b.layout_digest for b in self.buckets).encode()).hexdigest()

    def with_digests(self, digests: Sequence[str]) -> Manifest:
        if len(digests) != len(self.buckets):
            raise ManifestError(f"{len(digests)} digests for {len(self.buckets)} buckets")
        return replace(self, buckets=tuple(b.with_digest(d) for b, d in zip(self.buckets, digests, strict=True)))

    def without_digests(self) -> Manifest:
        return replace(self, buckets=tuple(b.with_digest(None) for b in self.buckets))

    def to_dict(self, *, buckets: bool = True) -> dict[str, Any]:
        """The JSON form (`buckets=False`: every field but the buckets)."""
        d: dict[str, Any] = {
            "format": MANIFEST_FORMAT,
            "format_version": MANIFEST_FORMAT_VERSION,
            "digest_algorithm": self.digest_algorithm,
            "version": self.version,
            "mode": self.mode,
            "lora_config": dict(self.lora_config) if self.lora_config is not None else None,
            "lora_name": self.lora_name,
            "base_version": self.base_version,
            "owner": self.owner,
            "timeout_s": self.timeout_s,
            **({"commit": self.commit} if self.commit != "staged" else {}),
        }
        if buckets:
            d["buckets"] = [b.to_dict() for b in self.buckets]
        return d

    def to_json(self) -> str:
        """`to_dict` as JSON text: sorted keys, no spaces; the buckets' entries as each
        bucket made them once (`BucketMeta.to_json`), byte for byte what
        `json.dumps(to_dict(), separators=(",", ":"), sort_keys=True)` writes."""
        text = json.dumps({**self.to_dict(buckets=False), "buckets": None}, separators=(",", ":"), sort_keys=True)
        # "buckets" sorts second, after "base_version" (an integer or null): the first match is ours
        buckets = ",".join(b.to_json() for b in self.buckets)
        return text.replace('"buckets":null', f'"buckets":[{buckets}]', 1)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, known: Manifest | None = None,
                  layout: Sequence[BucketMeta] | None = None) -> Manifest:
        """Parse and check a manifest's JSON form. `known`: a manifest parsed before (an
        engine passes the last one it began); its buckets' entries are reused where their
        JSON is the same (`BucketMeta.from_dict`), as a plan reused push after push sends.
        `layout`: the buckets, parsed and checked before (a layout an engine remembers),
        instead of `d`'s "buckets", which `d` then lacks; every check of a manifest's
        buckets as a whole (indices, names once, encodings for the mode) runs as for parsed ones."""
        if not isinstance(d, Mapping):
            raise ManifestError("manifest must be a JSON object")
        if d.get("format") != MANIFEST_FORMAT or d.get("format_version") != MANIFEST_FORMAT_VERSION:
            raise ManifestError(
                f"not a {MANIFEST_FORMAT} v{MANIFEST_FORMAT_VERSION} manifest "
                f"(format={d.get('format')!r}, format_version={d.get('format_version')!r})"
            )
        # Any well-formed name parses: the receiving side refuses one it does not compute
        # at begin, naming the ones it does (a newer trainer may name a newer algorithm).
        digest_algorithm = d.get("digest_algorithm", DIGEST_ALGORITHM)
        if not isinstance(digest_algorithm, str) or not 0 < len(digest_algorithm) <= 64:
            raise ManifestError(f"digest_algorithm must be a name such as {DIGEST_ALGORITHM!r}, "
                                f"got {digest_algorithm!r}")
        mode = d.get("mode", "full")
        if mode not in MODES:
            raise ManifestError(f"unknown mode {mode!r}; one of {MODES}")
        version = d.get("version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise ManifestError(f"version must be an integer, got {version!r}")
        if layout is not None:
            if "buckets" in d:
                raise ManifestError("a manifest sent by its layout carries no 'buckets'")
            buckets = tuple(layout)
        else:
            raw_buckets = d.get("buckets")
            if not isinstance(raw_buckets, list):
                raise ManifestError("manifest 'buckets' must be a list")
            known_buckets = known.buckets if known is not None else ()
            buckets = tuple(BucketMeta.from_dict(b, known=known_buckets[i] if i < len(known_buckets) else None)
                            for i, b in enumerate(raw_buckets))
        for i, b in enumerate(buckets):
            if b.index != i:
                raise ManifestError(f"bucket at position {i} has index {b.index}")
        seen: set[str] = set()
        for e in (e for b in buckets for e in b.entries):
            if e.hf_name in seen:
                raise ManifestError(f"tensor {e.hf_name!r} appears twice in the manifest")
            seen.add(e.hf_name)
        lora_config = d.get("lora_config")
        if lora_config is not None and not isinstance(lora_config, Mapping):
            raise ManifestError("lora_config must be an object or null")
        lora_name = d.get("lora_name")
        if lora_name is not None and not isinstance(lora_name, str):
            raise ManifestError("lora_name must be a string or null")
        if mode == "lora" and lora_name is None:
            raise ManifestError("a 'lora' manifest needs a lora_name")
        base_version = d.get("base_version")
        if base_version is not None and (not isinstance(base_version, int) or isinstance(base_version, bool)):
            raise ManifestError("base_version must be an integer or null")
        if mode in PARTIAL_MODES and base_version is None:
            raise ManifestError(f"a {mode!r} manifest needs the base_version it applies on top of")
        if mode != "sparse":
            sparse = [e.hf_name for b in buckets for e in b.entries if not e.is_dense]
            if sparse:
                raise ManifestError(f"tensor {sparse[0]!r}: sparse encodings travel in 'sparse' manifests only")
        else:
            undigested = [e.hf_name for b in buckets for e in b.entries if e.tensor_digest is None]
            if undigested:
                raise ManifestError(f"tensor {undigested[0]!r}: every tensor of a 'sparse' manifest needs the "
                                    "tensor_digest the engine must hold once it is applied")
        owner = d.get("owner")
        if owner is not None and (not isinstance(owner, str) or not 0 < len(owner) <= 200):
            raise ManifestError("owner must be a string of 1 to 200 characters or null")
        timeout_s = d.get("timeout_s")
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float)
                                      or not 0 < timeout_s < 1e6):
            raise ManifestError("timeout_s must be a positive number of seconds or null")
        commit = d.get("commit", "staged")
        if commit not in COMMITS:
            raise ManifestError(f"unknown commit {commit!r}; one of {COMMITS}")
        if commit == "streamed" and mode == "lora":
            raise ManifestError("a 'lora' manifest is committed staged (the adapter loads beside the served "
                                "weights); leave out 'commit'")
        return cls(version=version, mode=mode, buckets=buckets, lora_config=lora_config,
                   lora_name=lora_name, base_version=base_version, owner=owner,
                   timeout_s=float(timeout_s) if timeout_s is not None else None,
                   digest_algorithm=digest_algorithm, commit=commit)

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ManifestError(f"manifest is not valid JSON: {e}") from None
        return cls.from_dict(d)
