"""`VLLMEngine`: the weightsync engine for vLLM running weightsync's worker extension, in process or over HTTP.

It sends the worker verbs (`worker.py`) through a `Backend` (`backends.py`) and does the
engine-level part itself: pause and resume, the prefix-cache reset and cache salts, vLLM's
weight-version label, LoRA registration. The design: docs/VLLM.md, "The worker extension".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from weightsync.dtypes import dtype_from_name
from weightsync.engines.base import CLEANUP_TIMEOUT_S, Completion, EngineCapabilities, EngineUpdate, PausePolicy
from weightsync.engines.vllm.backends import (
    RPC_MARGIN_S,
    Backend,
    InProcessBackend,
    ServerBackend,
    worker_in_this_process,
)
from weightsync.engines.vllm.worker import EXTENSION
from weightsync.errors import (
    EngineError,
    IntegrityError,
    ManifestError,
    ManifestMismatchError,
    SyncTimeoutError,
    WeightSyncError,
)
from weightsync.formats.quantized import Quantization
from weightsync.links import Delivery, Link
from weightsync.manifest import BucketMeta, Manifest
from weightsync.reports import Ack
from weightsync.transports import TRANSPORTS, receiver_class

log = logging.getLogger(__name__)

CACHE_SALT_PREFIX = "weightsync-v"
"""`cache_salt` of requests for weight version N: "weightsync-v<N>"."""
MAX_GENERATE_ATTEMPTS = 3
"""Rounds of requests one `generate` call makes at most (see `generate`)."""


class _FetchedByWorkers:
    """Every transport whose bytes the workers fetch themselves (`collective_rpc` carries
    JSON, not bytes), read from the transports' receivers when first asked (the
    transport modules load on first use)."""

    def __get__(self, engine: object, owner: type | None = None) -> frozenset[str]:
        return frozenset(n for n in TRANSPORTS if not receiver_class(n).bytes_in_delivery)


class VLLMEngine:
    """One vLLM engine (all its TP x PP workers), in-process or behind a URL."""

    transports = _FetchedByWorkers()
    lora_transports = _FetchedByWorkers()
    url: str | None = None
    """The server form's URL; None in-process (the engine runs on the trainer's host)."""
    transports_note: str | None = None
    """Why a transport is missing from `transports`, said when one is asked for."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 60.0,
                 label: str | None = None, num_ranks: int | None = None) -> None:
        """The server form: `vllm serve` at `url` (docs/VLLM.md).

        `num_ranks` (the server's TP x PP) is asked of the server when first
        needed unless given.
        """
        self._backend: Backend = ServerBackend(url, api_key=api_key, timeout_s=timeout_s)
        self.url = url.rstrip("/")
        self.label = label or self.url
        self.timeout_s = timeout_s
        self._init_state(num_ranks)

    @classmethod
    def from_llm(cls, llm: Any, *, timeout_s: float = 60.0, label: str | None = None) -> VLLMEngine:
        """The in-process form: wrap a `vllm.LLM(..., worker_extension_cls=EXTENSION)`."""
        engine = cls.__new__(cls)
        engine._backend = InProcessBackend(llm)
        config = llm.llm_engine.vllm_config
        engine.label = label or f"vllm-inprocess:{config.model_config.model}"
        engine.timeout_s = timeout_s
        parallel = config.parallel_config
        engine._init_state(parallel.tensor_parallel_size * parallel.pipeline_parallel_size)
        if worker_in_this_process(llm):
            engine.transports = frozenset(n for n in engine.transports if not receiver_class(n).collective)
            engine.lora_transports = frozenset(n for n in engine.lora_transports if not receiver_class(n).collective)
            engine.transports_note = (
                "its worker runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0 with one rank), and one "
                "process cannot join a torch.distributed group twice ('A process group is already registered')")
        return engine

    def _init_state(self, num_ranks: int | None) -> None:
        """What the client knows of its engine; what a push has done with it is the push's `EngineUpdate`."""
        self._num_ranks = num_ranks
        """The engine's workers (TP x PP), given or asked of the engine once."""
        self._warned_unreset = False
        """A prefix cache left unreset was logged once at WARNING (later ones under in_place at INFO)."""

    # -- capabilities ------------------------------------------------------

    def capabilities(self, timeout_s: float) -> EngineCapabilities:
        """The workers stage every bucket and swap at commit (no pause while streaming);
        no deltas (vLLM reloads fused layers from all their checkpoint tensors, so
        "delta" pushes go out whole); sparse updates rebuilt from each worker's copy of
        the served version, reloaded whole fused group by group (`engines.vllm.worker`);
        adapters unloaded by name. Rank 0 tells (within
        `timeout_s`) the dtype vLLM serves and, unless it was given, the rank count."""
        info = self.info(timeout_s=timeout_s)
        if self._num_ranks is None:
            self._num_ranks = int(info["num_ranks"])
        kept = {str(n): dtype_from_name(str(d)) for n, d in (info.get("kept_dtypes") or {}).items()}
        return EngineCapabilities(num_ranks=self._num_ranks, dtype=dtype_from_name(str(info["dtype"])),
                                  kept_dtypes=kept,
                                  stages_updates=True, supports_delta=False, supports_sparse=True,
                                  reads_digests=False,
                                  unloads_adapters=True, transports=self.transports,
                                  lora_transports=self.lora_transports if info.get("lora_enabled") else frozenset(),
                                  quantization=Quantization.from_dict(info["quantization"])
                                  if info.get("quantization") else None,
                                  streams_commit=self.pauses and not info.get("quantization"))

    @property
    def pauses(self) -> bool:
        """vLLM can hold generation for this client (`vllm serve`'s `/pause`); in process it runs in
        the caller's own `llm.generate`, which nothing here can hold, so it takes no streamed commit."""
        return isinstance(self._backend, ServerBackend)

    @property
    def num_ranks(self) -> int:
        """The engine's workers (TP x PP); each joins a broadcast group with its own rank."""
        if self._num_ranks is None:
            self._num_ranks = int(self.info()["num_ranks"])
        return self._num_ranks

    @property
    def num_requests(self) -> int:
        """HTTP requests this client has sent (0 in process); a push's round trips are the difference."""
        return self._backend.num_requests

    def info(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """Rank 0's view: num_ranks, version (weightsync's counter), dirty, lora_enabled."""
        return self._rpc("weightsync_info", {}, timeout_s=self.timeout_s if timeout_s is None else timeout_s)[0]

    # -- protocol ----------------------------------------------------------

    def connect(self, link: Link) -> None:
        if receiver_class(link.transport).joins_session:
            self._rpc("weightsync_connect", {"link": link.to_dict()}, timeout_s=link.timeout_s)

    def disconnect(self, link: Link) -> None:
        if not receiver_class(link.transport).joins_session:
            return
        try:
            self._rpc("weightsync_disconnect", {"link": link.to_dict()},
                      timeout_s=min(CLEANUP_TIMEOUT_S, link.timeout_s), margin_s=0.0)
        except WeightSyncError as e:
            log.warning("%s: leaving the %s session: %s", self.label, link.transport, e)

    def pause(self, policy: PausePolicy, *, pause_id: str | None = None, timeout_s: float | None = None) -> None:
        """vLLM's `/pause?mode=` (its pauses are not named: `pause_id` is not sent)."""
        if policy.vllm_mode is not None:
            self._backend.pause(policy.vllm_mode, timeout_s=self._timeout(timeout_s))

    def resume(self, *, pause_id: str | None = None, timeout_s: float | None = None) -> None:
        """vLLM's `/resume`, except while its workers hold a streamed update that failed midway
        (a mix of two versions): vLLM then stays paused, its requests waiting, until a full
        push lands (docs/VLLM.md, "Streamed commits")."""
        if self.pauses:  # only a server can have taken a streamed update
            refusing = [r["refusing"] for r in self._rpc("weightsync_info", {}, timeout_s=self._timeout(timeout_s))
                        if r.get("refusing")]
            if refusing:
                log.warning("%s stays paused: %s", self.label, refusing[0])
                return
        self._backend.resume(timeout_s=self._timeout(timeout_s))

    def begin(self, manifest: Manifest, update: EngineUpdate) -> str | None:
        link = update.link
        allowed = self.lora_transports if manifest.is_adapter else self.transports
        if link.transport not in allowed:
            raise EngineError(self.label, f"transport {link.transport!r} is not supported for mode "
                              f"{manifest.mode!r}; use one of {sorted(allowed)}")
        if manifest.commit == "streamed" and update.policy.vllm_mode is None:
            raise EngineError(self.label, "a streamed update needs vLLM paused while it loads (it would "
                              "generate from a mix of versions): use pause='retract', 'in_place' or 'abort', "
                              "or commit='staged'")
        results = self._rpc("weightsync_begin", {"manifest": manifest.to_dict(), "link": link.to_dict()},
                            timeout_s=link.timeout_s)
        note = results[0].get("preempted")
        return str(note) if note else None

    def receive(self, bucket: BucketMeta, delivery: Delivery, update: EngineUpdate) -> None:
        version, link = update.version, update.link
        assert bucket.digest is not None, "buckets are hashed before they are sent"
        receiver = receiver_class(delivery.transport)
        if receiver.bytes_in_delivery or receiver.reads_at_commit:  # the workers fetch the bytes themselves
            raise ValueError(f"{self.label}: no per-bucket receive for transport {delivery.transport!r}")
        self._rpc("weightsync_receive", {"version": version, "index": bucket.index, "digest": bucket.digest,
                                         "delivery": delivery.to_dict()}, timeout_s=link.timeout_s)

    def ready(self, manifest: Manifest, update: EngineUpdate) -> None:
        """Every rank still holds the update, then every rank seals it (disk: reads it now;
        every bucket's bytes the trainer's), so a refusal comes before any replica commits."""
        version, link = manifest.version, update.link
        for rank, info in enumerate(self._rpc("weightsync_info", {}, timeout_s=link.timeout_s)):
            if info.get("open_version") != version:
                raise EngineError(self.label, f"update v{version} is no longer open on rank {rank} (open: "
                                  f"{info.get('open_version')}); it expired, was replaced, or the engine restarted")
        self._seal(manifest, link)

    def commit(self, manifest: Manifest, update: EngineUpdate) -> Ack:
        link = update.link
        if not update.checked:  # `ready` sealed it already with several replicas
            self._seal(manifest, link)  # every rank checks before any rank applies
        results = self._rpc("weightsync_commit", {"version": manifest.version}, timeout_s=link.timeout_s)
        ack = self._combine_acks(results)
        if manifest.is_adapter:
            assert manifest.lora_name is not None
            path = results[0].get("lora_path")
            if not path:
                raise EngineError(self.label, f"adapter {manifest.lora_name!r}: rank 0 reported no directory")
            self._backend.add_lora(manifest.lora_name, str(path), timeout_s=link.timeout_s)
        else:
            self._reset_prefix_cache(update.policy, timeout_s=link.timeout_s)
        self._backend.set_weight_version(str(manifest.version), timeout_s=link.timeout_s)
        return ack

    def _seal(self, manifest: Manifest, link: Link) -> None:
        """Every rank checks everything its commit would, applying nothing (idempotent)."""
        self._rpc("weightsync_seal", {"version": manifest.version, "digests": [b.digest for b in manifest.buckets]},
                  timeout_s=link.timeout_s)

    def abort(self, update: EngineUpdate, *, timeout_s: float | None = None) -> None:
        self._rpc("weightsync_abort", {"version": update.version, "owner": update.owner},
                  timeout_s=min(CLEANUP_TIMEOUT_S, self._timeout(timeout_s)), margin_s=0.0)

    def unload_lora(self, lora_name: str, *, timeout_s: float | None = None) -> None:
        """Stop routing requests to an adapter; its files go one push later (a
        request still running on it can reload it meanwhile). Raises
        `AdapterNotLoadedError` when no adapter of that name is loaded."""
        timeout_s = self._timeout(timeout_s)
        self._backend.remove_lora(lora_name, timeout_s=timeout_s)
        self._rpc("weightsync_forget_lora", {"lora_name": lora_name}, timeout_s=timeout_s)

    # -- generation --------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 0.0,
                 lora_name: str | None = None, seed: int | None = None) -> list[Completion]:
        """Generate for token-id prompts (EOS ignored); tokens, their logprobs, the weight version.

        Every request carries `cache_salt()` for the version served when it is
        sent. An answer prefilled under a newer version than its salt (a push
        committed in between, so it may have reused the older version's KV) is
        asked again with the new salt, in at most MAX_GENERATE_ATTEMPTS rounds;
        where vLLM reports no weight versions (no `--enable-scale-out`), every
        answer of a batch during which the served version changed is. The
        served version is asked of the engine once per round (twice without
        weight versions).
        """
        todo = list(range(len(prompts)))
        answers: dict[int, Completion] = {}
        for _ in range(MAX_GENERATE_ATTEMPTS):
            version = int(self.weight_version())
            completions = self._backend.generate(
                [list(prompts[i]) for i in todo], max_new_tokens=max_new_tokens, temperature=temperature,
                lora_name=lora_name, seeds=[None if seed is None else seed + i for i in todo],
                cache_salt=self.cache_salt(version))
            prefilled = [_prefill_version(c) for c in completions]
            version_after = int(self.weight_version()) if None in prefilled else version
            stale = [i for i, c, first in zip(todo, completions, prefilled, strict=True)
                     if (version_after if first is None else first) > version]
            answers.update((i, c) for i, c in zip(todo, completions, strict=True) if i not in stale)
            if not stale:
                return [answers[i] for i in range(len(prompts))]
            log.info("%s: %d answer(s) salted for v%d were prefilled under a newer version; asking again",
                     self.label, len(stale), version)
            todo = stale
        raise EngineError(self.label, f"{len(todo)} answer(s) were prefilled under a newer version than their "
                          f"cache salt {MAX_GENERATE_ATTEMPTS} times in a row (pushes commit faster than "
                          f"requests start); generate between pushes")

    def weight_version(self) -> str:
        """weightsync's version counter in the workers, as a string."""
        return str(self.info()["version"])

    def cache_salt(self, version: int | None = None) -> str:
        """The `cache_salt` for requests to this engine: "weightsync-v<version>",
        by default for the version the workers serve now (asked of the engine).

        Requests with different salts share no prefix-cache entries, so a request
        salted for the served version reuses only KV computed with these weights.
        Send it in the request body of `/v1/completions`, `/v1/chat/completions`
        or `/inference/v1/generate` (`TokensPrompt(..., cache_salt=...)` in
        process); read it after the push returned (`cache_salt(report.version)`
        needs no round trip). A request salted before a push and prefilled after
        it may reuse the older version's KV: its first `weight_versions` span
        then names a newer version than its salt (ask again, as `generate` does).
        """
        return f"{CACHE_SALT_PREFIX}{int(self.weight_version()) if version is None else version}"

    def loaded_loras(self) -> list[str]:
        """Adapter names requests can use now."""
        return self._backend.loaded_loras()

    def close(self) -> None:
        self._backend.close()

    # -- internals ---------------------------------------------------------

    def _timeout(self, timeout_s: float | None) -> float:
        """The caller's bound (a push's timeout_s), else this client's own."""
        return self.timeout_s if timeout_s is None else timeout_s

    def _rpc(self, method: str, body: dict[str, Any], *, timeout_s: float,
             margin_s: float = RPC_MARGIN_S) -> list[dict[str, Any]]:
        """Call `method` on every worker; raise the first worker's error as a weightsync error."""
        results = self._backend.rpc(method, json.dumps(body), timeout_s=timeout_s + margin_s, margin_s=margin_s)
        if not results:
            raise EngineError(self.label, f"{method}: no worker answered")
        for result in results:
            if not isinstance(result, dict) or "ok" not in result:
                raise EngineError(self.label, f"{method}: unexpected answer {str(result)[:200]!r}; is the "
                                  f"engine running weightsync's worker extension ({EXTENSION})?")
            if not result["ok"]:
                raise self._error(method, result)
        return results

    def _error(self, method: str, result: dict[str, Any]) -> WeightSyncError:
        error = result.get("error") or {}
        kind, message = str(error.get("type")), str(error.get("message"))
        where = f"{method} on rank {result.get('rank')}: {message}"
        if kind == "ManifestMismatchError":
            return ManifestMismatchError(f"{self.label}: {where}", missing=error.get("missing") or (),
                                         unexpected=error.get("unexpected") or (),
                                         mismatched=error.get("mismatched") or ())
        if kind == "IntegrityError":
            return IntegrityError(f"{self.label}: {where}")
        if kind == "ManifestError":
            return ManifestError(f"{self.label}: {where}")
        if kind in ("SyncTimeoutError", "TimeoutError"):
            return SyncTimeoutError(f"{self.label}: {where}")
        status, retry_after = error.get("status"), error.get("retry_after_s")
        prefix = "" if kind == "EngineError" else f"{kind}: "
        return EngineError(self.label, f"{method} on rank {result.get('rank')}: {prefix}{message}",
                           status=int(status) if status is not None else None,
                           retry_after_s=float(retry_after) if retry_after is not None else None)

    def _combine_acks(self, results: list[dict[str, Any]]) -> Ack:
        acks = [Ack.from_dict(r["ack"], engine=self.label) for r in results]
        for rank, ack in enumerate(acks[1:], start=1):
            if ack.without_memory() != acks[0].without_memory():
                raise IntegrityError(f"{self.label}: worker {rank} acked {ack.to_dict()} but worker 0 acked "
                                     f"{acks[0].to_dict()}; the engine's ranks hold different weights")
        return Ack.summed(acks)  # the workers' memory: separate processes of one host

    def _reset_prefix_cache(self, policy: PausePolicy, *, timeout_s: float) -> None:
        """After a full commit: drop every prefix-cache entry (docs/VLLM.md).

        Only "in_place" promises the running requests their KV; under any other
        policy they are preempted (recomputed), so the reset cannot fail.
        """
        preempt = policy is not PausePolicy.IN_PLACE
        try:
            if self._backend.reset_prefix_cache(preempt_running=preempt, timeout_s=timeout_s):
                return
            why = "requests still hold KV blocks"
        except WeightSyncError as e:  # vLLM raises if even preempting cannot free the blocks
            why = str(e)
        expected = policy is PausePolicy.IN_PLACE and self._warned_unreset  # every in_place push under load
        self._warned_unreset = True
        log.log(logging.INFO if expected else logging.WARNING,
                "%s: the prefix cache was not reset (pause=%s: %s). Requests salted with cache_salt() "
                "(every request of generate()) are unaffected; unsalted requests may reuse KV computed with "
                "older weights until a later commit resets it", self.label, policy.value, why)


def _prefill_version(completion: Completion) -> int | None:
    """The version that prefilled an answer (its first weight-version span), if vLLM said."""
    first = completion.weight_version.split("+", 1)[0]
    return int(first) if first.isdigit() else None  # vLLM's unset label is "default"
