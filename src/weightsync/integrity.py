"""Digests and the checks built on them.

A bucket's digest is computed over its packed bytes with the algorithm its
manifest names (`weightsync.digests`: xxh3_64 on the host, wsmix64 on the device
that holds the bytes). Because the packed bytes are the tensors' bytes back to
back, the same digest can be computed tensor by tensor (`BucketHasher`) without
ever packing, which is how an engine that receives tensors one by one (a
safetensors file, a vLLM loader) checks a bucket.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

import torch

from weightsync.digests import XXH3_64, Hasher, hasher
from weightsync.digests import byte_view as byte_view  # re-exported: callers import them from here
from weightsync.digests import digest as digest
from weightsync.errors import IntegrityError, ManifestMismatchError, format_names
from weightsync.manifest import BucketMeta, Manifest, TensorEntry, TensorMeta
from weightsync.reports import Ack


class BucketHasher:
    """Incremental digest of a bucket fed tensor by tensor, in bucket order.

    `BucketHasher(a).update(x).update(y).hexdigest() == digest(pack([x, y]), a)`.
    """

    def __init__(self, algorithm: str = XXH3_64) -> None:
        self._h: Hasher = hasher(algorithm)

    def update(self, tensor: torch.Tensor) -> BucketHasher:
        self._h.update(tensor)
        return self

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def check_bucket(bucket: BucketMeta, data: torch.Tensor | bytes | memoryview, algorithm: str = XXH3_64, *,
                 computed: str | None = None) -> str:
    """Verify received bytes against a bucket's size and digest (computed with `algorithm`,
    the manifest's, on the device that holds `data`); return the digest.

    `computed`: the digest of `data` as this process computed it while writing `data`
    (`digests.copy_hashed`), so the bytes are not read again; None: hashed here.
    Raises IntegrityError naming the bucket when the length or the digest is off.
    """
    size = data.numel() if isinstance(data, torch.Tensor) else len(memoryview(data).cast("B"))
    if size != bucket.nbytes:
        raise IntegrityError(
            f"bucket {bucket.index}: received {size} bytes, manifest says {bucket.nbytes} (truncated or padded)"
        )
    got = digest(data, algorithm) if computed is None else computed
    if bucket.digest is not None and got != bucket.digest:
        raise IntegrityError(
            f"bucket {bucket.index}: digest {got} != expected {bucket.digest} "
            f"(first tensor {bucket.entries[0].hf_name if bucket.entries else '-'!r}); bytes were corrupted in transit"
        )
    return got


def check_manifest_fits(
    manifest: Manifest,
    expected: Mapping[str, TensorMeta],
    *,
    partial: bool,
) -> None:
    """The engine-side dry run: does `manifest` fit the engine's parameters?

    `expected` maps each name the engine can load to its dtype and shape. With
    `partial=False` every expected name must appear exactly once; with
    `partial=True` (delta updates) a subset is fine. Raises ManifestMismatchError
    naming every offender; nothing is loaded.
    """
    check_fits(
        manifest.entries(), expected, partial=partial,
        refused=f"update v{manifest.version} refused before any byte moved",
    )


def check_fits(
    sent: Iterable[TensorMeta | TensorEntry],
    expected: Mapping[str, TensorMeta],
    *,
    partial: bool,
    refused: str = "update refused",
    holder: str = "engine",
) -> None:
    """Every sent name (a tensor's meta or manifest entry) known to `expected` with an
    equal shape and dtype (and, unless `partial`, every expected name sent). Raises
    ManifestMismatchError starting with `refused` and naming every offender."""
    by_name = {m.hf_name: m for m in sent}
    unexpected: list[str] = []
    mismatched: list[str] = []
    get = expected.get
    for name, m in by_name.items():  # one lookup per name: a manifest may list tens of thousands
        want = get(name)
        if want is None:
            unexpected.append(name)
        elif want.shape != m.shape or want.dtype != m.dtype:
            mismatched.append(f"{name}: sent {tuple(m.shape)} {m.dtype}, {holder} has {tuple(want.shape)} "
                              f"{want.dtype}")
    # every name sent is known but `unexpected`: as many known as expected means none is missing
    missing = [] if partial or len(by_name) - len(unexpected) == len(expected) \
        else sorted(set(expected) - set(by_name))
    if not (unexpected or missing or mismatched):
        return
    unexpected.sort()
    parts = []
    if unexpected:
        parts.append(f"{len(unexpected)} unknown name(s): {format_names(unexpected)}")
    if missing:
        parts.append(f"{len(missing)} missing name(s): {format_names(missing)}")
    if mismatched:
        parts.append(f"{len(mismatched)} shape/dtype mismatch(es): " + "; ".join(mismatched[:8]))
    raise ManifestMismatchError(
        f"{refused}: " + " | ".join(parts),
        missing=missing,
        unexpected=unexpected,
        mismatched=[m.split(":", 1)[0] for m in mismatched],
    )


def names_digest(names: Iterable[str]) -> str:
    """The digest of a set of names, whatever their order: xxh3_64 of the UTF-8 JSON array
    of the names sorted by code point, without spaces (`["a","b"]`). Two sets of names
    have the same digest only if they are equal (but for a 64-bit collision)."""
    text = json.dumps(sorted(names), ensure_ascii=False, separators=(",", ":"))
    return digest(text.encode("utf-8"))


@functools.lru_cache(maxsize=8)
def manifest_names_digest(hf_names: tuple[str, ...]) -> str:
    """`names_digest` of a manifest's names (`Manifest.hf_names`), kept for the pushes that
    send the same names, on the trainer and on the engine: an RL loop sends one model's
    names push after push, and a tuple of the same strings hashes and compares in a pass."""
    return names_digest(hf_names)


def with_sent_names(ack: Ack, sent_names: Sequence[str]) -> Ack:
    """`ack` with its loaded names filled in from `sent_names` where it carries only their
    digest (`Ack.names_digest`) and that digest is the one of `sent_names`: the engine
    loaded exactly those. Any other ack as it is (`ack_problems` refuses one whose digest
    differs)."""
    if ack.loaded_names or ack.names_digest is None or ack.names_digest != manifest_names_digest(tuple(sent_names)):
        return ack
    return replace(ack, loaded_names=frozenset(sent_names))


def digest_checked(ack: Ack) -> bool:
    """Whether `ack` carries the digests to check: a stock SGLang's reports none."""
    return not (ack.digests and all(d is None for d in ack.digests))


def ack_problems(manifest: Manifest, ack: Ack, *, engine_names: Iterable[str] | None = None) -> list[str]:
    """Compare an engine's ack with what was sent; an empty list means verified.

    A "sparse" update must also ack, for every tensor it touched, the digest of the
    whole tensor the engine holds now, equal to the trainer's (`TensorEntry.tensor_digest`).
    `engine_names` are the names the engine should report as loaded (the sent
    names after any hf -> engine renaming); defaults to the manifest's names. An ack
    that still carries only the digest of its loaded names (`Ack.names_digest`; see
    `with_sent_names`) is checked against the digest of those: a problem that cannot
    name the tensors (an engine sends the list when its loaded names are not its
    manifest's, so this means the engine's manifest was not the trainer's).
    """
    problems: list[str] = []
    if ack.version != manifest.version:
        problems.append(f"{ack.engine}: acked version {ack.version}, pushed {manifest.version}")
    want_digests: Sequence[str | None] = manifest.digests
    if len(ack.digests) != len(want_digests):
        problems.append(f"{ack.engine}: acked {len(ack.digests)} bucket digests, sent {len(want_digests)}")
    else:
        bad = [i for i, (a, w) in enumerate(zip(ack.digests, want_digests, strict=True)) if a != w]
        if bad:
            problems.append(f"{ack.engine}: digest mismatch in bucket(s) {bad[:8]}")
    if manifest.mode == "sparse":
        want_whole = {e.hf_name: e.tensor_digest for e in manifest.entries()}
        wrong = sorted(n for n, d in want_whole.items() if ack.tensor_digests.get(n) != d)
        if wrong:
            problems.append(f"{ack.engine}: whole-tensor digest differs from the trainer's (or was not acked) "
                            f"for {format_names(wrong)}")
    sent = tuple(engine_names) if engine_names is not None else manifest.hf_names
    if not ack.loaded_names and ack.names_digest is not None:  # the digest of names other than those sent
        if ack.names_digest != manifest_names_digest(sent):
            problems.append(f"{ack.engine}: the names it loaded (digest {ack.names_digest}) are not the "
                            f"{len(set(sent))} names sent (digest {manifest_names_digest(sent)})")
        return problems
    want_names = set(sent)
    if set(ack.loaded_names) != want_names:
        missing = want_names - set(ack.loaded_names)
        extra = set(ack.loaded_names) - want_names
        if missing:
            problems.append(f"{ack.engine}: did not load {format_names(missing)}")
        if extra:
            problems.append(f"{ack.engine}: loaded names never sent {format_names(extra)}")
    return problems
