"""The trainer side of the `"weightsync"` weight-transfer backend: `VLLMTransferEngine`, a `VLLMEngine` whose
worker verbs are vLLM's RL calls (`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
`finish_weight_update`), in process or over HTTP.

Answers are read from `transfer_answers` (vLLM returns none). How each weightsync verb maps
to vLLM's calls: docs/VLLM.md, "The trainer side".
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import secrets
import threading
from typing import Any, Protocol

from weightsync.engines.base import Completion, EngineCapabilities
from weightsync.engines.vllm.backends import RPC_MARGIN_S, Backend, InProcessBackend, ServerBackend
from weightsync.engines.vllm.client import VLLMEngine
from weightsync.engines.vllm.transfer_answers import AnswerBox
from weightsync.errors import EngineError, WeightSyncError
from weightsync.hosts import is_local_host, local_address_towards, url_host

log = logging.getLogger(__name__)

LORA_REFUSED = ("the vLLM weight-transfer backend loads base weights only; adapters need weightsync's worker "
                "extension (ws.VLLMEngine)")


class TransferClient(Protocol):
    """vLLM's trainer-side control plane (`VLLMWeightSyncClient`: the four verbs), each
    call bounded by `timeout_s` (set before each call)."""

    timeout_s: float

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: Any) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class _LLMClient:
    """The four verbs on every worker of an in-process `vllm.LLM`, as its own RL methods
    call them (`collective_rpc`), with a timeout, through `InProcessBackend` (one caller at a
    time; vLLM's exceptions become weightsync errors)."""

    def __init__(self, inner: InProcessBackend, timeout_s: float) -> None:
        self.inner = inner
        self.timeout_s = timeout_s

    def _rpc(self, method: str, **kwargs: Any) -> None:
        self.inner.call(method, lambda: self.inner.llm.collective_rpc(method, timeout=self.timeout_s, kwargs=kwargs))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._rpc("init_weight_transfer_engine", init_info=init_info)

    def start_weight_update(self) -> None:
        self._rpc("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._rpc("update_weights", update_info=update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._rpc("finish_weight_update")
        if weight_version is not None:
            self.inner.set_weight_version(weight_version, timeout_s=self.timeout_s)


class _HttpClient:
    """The four verbs as `vllm serve`'s RL routes (VLLM_SERVER_DEV_MODE=1)."""

    def __init__(self, server: ServerBackend, timeout_s: float) -> None:
        self.http = server.http
        self.timeout_s = timeout_s

    def _post(self, path: str, body: dict[str, Any]) -> None:
        # a fresh connection each: after a worker's exception vLLM answers 500 and then resets the connection
        response = self.http.request("POST", path, json_body=body, allow=(404,), timeout_s=self.timeout_s,
                                     headers={"Connection": "close"})
        if response.status_code == 404:
            raise EngineError(self.http.base_url, f"POST {path}: 404; start vLLM with VLLM_SERVER_DEV_MODE=1")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("/start_weight_update", {})

    def update_weights(self, update_info: Any) -> None:
        self._post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("/finish_weight_update", {} if weight_version is None else {"weight_version": weight_version})


class _Transfer(Backend):
    """`VLLMEngine`'s backend with the worker verbs as vLLM's weight-transfer calls;
    generation control goes to the wrapped form (`InProcessBackend` or `ServerBackend`)."""

    def __init__(self, inner: Backend, client: TransferClient, *, who: str, answers: AnswerBox) -> None:
        self.inner = inner
        self.client = client
        self.who = who
        self.answers = answers
        self.num_ranks: int | None = None
        self._seq = itertools.count(secrets.randbits(31))
        self._active = False
        """This client holds vLLM's update session (between its start and its finish)."""
        self._lock = threading.Lock()

    # -- the worker verbs ------------------------------------------------------------

    def rpc(self, method: str, request: str, *, timeout_s: float, margin_s: float = RPC_MARGIN_S) -> list[Any]:
        verb, body = method.removeprefix("weightsync_"), json.loads(request)
        with self._lock:  # one vLLM call at a time: answers are numbered in order
            self.client.timeout_s = timeout_s
            if verb in ("info", "connect", "disconnect"):
                link = {"connect": {"join": body.get("link")}, "disconnect": {"leave": body.get("link")}}
                return self._call("init", lambda seq: self.client.init_weight_transfer_engine(
                    {"answers": self.answers.channel, "seq": seq, **link.get(verb, {})}))
            if verb == "begin":
                return self._begin(body)
            if verb == "receive":
                return self._update({"bucket": body})
            if verb == "seal":
                return self._update({"commit": int(body["version"]), "digests": body.get("digests")})
            if verb == "commit":
                return self._commit(int(body["version"]))
            if verb == "abort":
                return self._finish() if self._active else [{"ok": True}]
            raise EngineError(self.who, f"{method}: {LORA_REFUSED}")

    def _begin(self, body: dict[str, Any]) -> list[Any]:
        try:
            self.client.start_weight_update()
            self._active = True
        except WeightSyncError as refused:  # "already active" (vLLM's HTTP 500 may not say so)
            log.warning("%s: vLLM refused to start an update session (%s); if one is still open (a trainer died "
                        "mid-push?), this begin goes ahead in it and the workers decide whether its update may be "
                        "dropped", self.who, refused)
            try:
                return self._checked_begin(body)
            except EngineError:  # no worker answered: no session was open, vLLM's refusal stands
                raise refused from None
        return self._checked_begin(body)

    def _checked_begin(self, body: dict[str, Any]) -> list[Any]:
        answers = self._update({"begin": body})
        if all(a["ok"] for a in answers):
            self._active = True
        elif self._active:
            self._finish()  # close vLLM's session; nothing was staged
        return answers

    def _commit(self, version: int) -> list[Any]:
        """vLLM's finish, which applies what the seal call sealed on every worker."""
        answers = self._finish()
        return [a if not a.get("ok") or "ack" in a else
                {"ok": False, "rank": a.get("rank"), "error": {"type": "IntegrityError", "message":
                 f"update v{version} was dropped at finish instead of applied"}} for a in answers]

    def _update(self, info: dict[str, Any]) -> list[Any]:
        return self._call("update_weights",
                          lambda seq: self.client.update_weights({"seq": seq, "answers": self.answers.channel, **info}))

    def _finish(self) -> list[Any]:
        self._active = False
        return self._call("finish_weight_update", lambda seq: self.client.finish_weight_update())

    def _call(self, what: str, send: Any) -> list[Any]:
        """Send one numbered call and read every worker's answer to it. A finish
        carries no number: the workers answer it as the call after the last one."""
        seq = next(self._seq)
        failure: WeightSyncError | None = None
        try:
            send(seq)
        except WeightSyncError as e:  # vLLM's message, if any; the answer file says more
            failure = e
        try:
            if self.num_ranks is None:
                first = self.answers.read(seq, num_ranks=1, who=self.who, what=what)[0]
                self.num_ranks = int(first.get("num_ranks") or 1)
            return self.answers.read(seq, num_ranks=self.num_ranks, who=self.who, what=what)
        except EngineError:
            if failure is not None:
                raise failure from None
            raise

    # -- everything else: the wrapped form ---------------------------------------------

    def pause(self, mode: str, *, timeout_s: float) -> None:
        self.inner.pause(mode, timeout_s=timeout_s)

    def resume(self, *, timeout_s: float) -> None:
        self.inner.resume(timeout_s=timeout_s)

    def reset_prefix_cache(self, *, preempt_running: bool, timeout_s: float) -> bool:
        return self.inner.reset_prefix_cache(preempt_running=preempt_running, timeout_s=timeout_s)

    def set_weight_version(self, version: str, *, timeout_s: float) -> None:
        self.inner.set_weight_version(version, timeout_s=timeout_s)

    def add_lora(self, lora_name: str, path: str, *, timeout_s: float) -> None:
        raise EngineError(self.who, LORA_REFUSED)

    def remove_lora(self, lora_name: str, *, timeout_s: float) -> None:
        raise EngineError(self.who, LORA_REFUSED)

    def loaded_loras(self) -> list[str]:
        return []

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float,
                 lora_name: str | None, seeds: list[int | None], cache_salt: str) -> list[Completion]:
        return self.inner.generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                   lora_name=lora_name, seeds=seeds, cache_salt=cache_salt)

    @property
    def num_requests(self) -> int:
        return self.inner.num_requests

    def close(self) -> None:
        self.inner.close()
        self.answers.close()


class VLLMTransferEngine(VLLMEngine):
    """A vLLM engine reached through its weight-transfer API with the `"weightsync"` backend.

    Same verbs, report and guarantees as `VLLMEngine` for full pushes over shm,
    disk and broadcast, plus deltas of whole fused layers; no LoRA
    (`lora_transports` is empty).

    Where the workers answer (`engines.vllm.transfer_answers`): in `answer_dir` (a directory
    both sides read) if given; else in a TCP store on `answer_host` (an address
    of this host the workers reach) if given, or by default for a server on
    another host; else in a temporary directory of this host.
    """

    lora_transports = frozenset[str]()

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 60.0,
                 label: str | None = None, num_ranks: int | None = None, answer_dir: str | None = None,
                 answer_host: str | None = None) -> None:
        super().__init__(url, api_key=api_key, timeout_s=timeout_s, label=label, num_ranks=num_ranks)
        server = self._backend
        assert isinstance(server, ServerBackend)
        host = url_host(url)
        if answer_dir is None and answer_host is None and host is not None and not is_local_host(host):
            answer_host = local_address_towards(host)
        answers = AnswerBox(directory=answer_dir, store_host=answer_host)
        self._backend = _Transfer(server, _HttpClient(server, timeout_s), who=self.label, answers=answers)

    def capabilities(self, timeout_s: float) -> EngineCapabilities:
        """`VLLMEngine`'s, with deltas (of whole fused layers: the workers' `fused_groups`)
        and sparse updates (each worker rebuilds the touched tensors from its copy of the
        served version and reloads their whole fused groups, as the worker extension)."""
        info = self.info(timeout_s=timeout_s)
        groups = tuple(tuple(str(n) for n in g) for g in info.get("fused_groups") or ())
        return dataclasses.replace(super().capabilities(timeout_s), supports_delta=True, supports_sparse=True,
                                   fused_groups=groups)

    @classmethod
    def from_llm(cls, llm: Any, *, timeout_s: float = 60.0, label: str | None = None,
                 answer_dir: str | None = None, answer_host: str | None = None) -> VLLMTransferEngine:
        """Wrap `vllm.LLM(..., weight_transfer_config={"backend": "weightsync"})`."""
        engine = super().from_llm(llm, timeout_s=timeout_s, label=label)
        assert isinstance(engine, VLLMTransferEngine)
        inner = engine._backend
        assert isinstance(inner, InProcessBackend)
        answers = AnswerBox(directory=answer_dir, store_host=answer_host)
        engine._backend = _Transfer(inner, _LLMClient(inner, timeout_s), who=engine.label, answers=answers)
        return engine


__all__ = ["LORA_REFUSED", "TransferClient", "VLLMTransferEngine"]
