"""How `VLLMEngine` reaches vLLM: the in-process and the server form behind one `Backend` interface.

`Backend` is the interface the clients of this package share (`client.VLLMEngine` calls it;
`transfer_client` wraps either form to send the worker verbs through vLLM's weight-transfer
calls instead). vLLM itself is imported only inside the in-process form's methods.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from weightsync.engines.base import Completion
from weightsync.engines.json_client import JsonClient
from weightsync.engines.vllm.worker import EXTENSION
from weightsync.errors import AdapterNotLoadedError, EngineError, SyncTimeoutError

log = logging.getLogger(__name__)
T = TypeVar("T")

RPC_MARGIN_S = 10.0
"""Added to a verb's own timeout for the RPC carrying it, so the worker's error comes first."""


class Backend:
    """What differs between the in-process and the server form: the worker verbs (`rpc`)
    and the engine-level calls `VLLMEngine` makes around them. Implemented here by
    `InProcessBackend` and `ServerBackend`, and by `transfer_client`'s backend, which
    wraps either of them."""

    def rpc(self, method: str, request: str, *, timeout_s: float, margin_s: float = RPC_MARGIN_S) -> list[Any]:
        """Call `method` on every worker; the transport may wait `margin_s` beyond `timeout_s`."""
        raise NotImplementedError

    def pause(self, mode: str, *, timeout_s: float) -> None:
        raise NotImplementedError

    def resume(self, *, timeout_s: float) -> None:
        raise NotImplementedError

    def reset_prefix_cache(self, *, preempt_running: bool, timeout_s: float) -> bool:
        """True if the prefix cache is now empty; `preempt_running` makes running
        requests recompute their KV so that the reset cannot fail."""
        raise NotImplementedError

    def set_weight_version(self, version: str, *, timeout_s: float) -> None:
        raise NotImplementedError

    def add_lora(self, lora_name: str, path: str, *, timeout_s: float) -> None:
        raise NotImplementedError

    def remove_lora(self, lora_name: str, *, timeout_s: float) -> None:
        """Raises AdapterNotLoadedError for an unknown name."""
        raise NotImplementedError

    def loaded_loras(self) -> list[str]:
        raise NotImplementedError

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float,
                 lora_name: str | None, seeds: list[int | None], cache_salt: str) -> list[Completion]:
        """One answer per prompt; `seeds[i]` samples prompts[i]; every request carries `cache_salt`."""
        raise NotImplementedError

    @property
    def num_requests(self) -> int:
        """HTTP requests sent so far (none in process)."""
        return 0

    def close(self) -> None:
        return None


def worker_in_this_process(llm: Any) -> bool:
    """The `LLM`'s engine core runs in this process (no engine-core process) with one
    rank, so its only worker runs here too."""
    from vllm.v1.engine.core_client import InprocClient

    parallel = llm.llm_engine.vllm_config.parallel_config
    return isinstance(llm.llm_engine.engine_core, InprocClient) and parallel.world_size == 1


class InProcessBackend(Backend):
    """A `vllm.LLM` in this process; calls serialised (its engine client is not thread-safe)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self._lock = threading.Lock()
        self._lora_ids = itertools.count(1)
        self._loras: dict[str, Any] = {}  # lora_name -> LoRARequest

    def call(self, what: str, fn: Callable[[], T], hint: str = "") -> T:
        """Run `fn` on the LLM, one caller at a time; vLLM's failures become weightsync errors.
        Every call on this `LLM` goes through here (`transfer_client` sends vLLM's own RL
        calls this way too)."""
        with self._lock:
            try:
                return fn()
            except TimeoutError as e:
                raise SyncTimeoutError(f"vllm-inprocess {what}: no answer in time: {e}") from e
            except Exception as e:  # vLLM raises a bare Exception carrying the engine's message
                raise EngineError("vllm-inprocess", f"{what}: {type(e).__name__}: {e}{hint}") from e

    def rpc(self, method: str, request: str, *, timeout_s: float, margin_s: float = RPC_MARGIN_S) -> list[Any]:
        hint = f"; is the LLM built with worker_extension_cls={EXTENSION!r}?"
        return list(self.call(method, lambda: self.llm.collective_rpc(method, timeout=timeout_s, args=(request,)),
                               hint))

    # The in-process LLM's own calls take no timeout; they run in this process.

    def pause(self, mode: str, *, timeout_s: float) -> None:
        return None  # generation only runs inside the caller's llm.generate

    def resume(self, *, timeout_s: float) -> None:
        return None

    def reset_prefix_cache(self, *, preempt_running: bool, timeout_s: float) -> bool:
        return bool(self.call("reset_prefix_cache", lambda: self.llm.reset_prefix_cache(preempt_running)))

    def set_weight_version(self, version: str, *, timeout_s: float) -> None:
        self.call("set_weight_version", lambda: self.llm.llm_engine.set_weight_version(version))

    def add_lora(self, lora_name: str, path: str, *, timeout_s: float) -> None:
        from vllm.lora.request import LoRARequest

        previous = self._loras.get(lora_name)
        lora_id = previous.lora_int_id if previous is not None else next(self._lora_ids)
        request = LoRARequest(lora_name=lora_name, lora_int_id=lora_id, lora_path=path, load_inplace=True)
        self.call(f"add_lora {lora_name!r}", lambda: self.llm.llm_engine.add_lora(request))
        self._loras[lora_name] = request

    def remove_lora(self, lora_name: str, *, timeout_s: float) -> None:
        request = self._loras.pop(lora_name, None)
        if request is None:
            raise AdapterNotLoadedError("vllm-inprocess",
                                        f"no adapter {lora_name!r} is loaded; loaded: {sorted(self._loras)}")
        self.call(f"remove_lora {lora_name!r}", lambda: self.llm.llm_engine.remove_lora(request.lora_int_id))

    def loaded_loras(self) -> list[str]:
        return sorted(self._loras)

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float,
                 lora_name: str | None, seeds: list[int | None], cache_salt: str) -> list[Completion]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        lora = None
        if lora_name is not None:
            lora = self._loras.get(lora_name)
            if lora is None:
                raise EngineError("vllm-inprocess", f"no adapter {lora_name!r}; loaded: {sorted(self._loras)}")
        params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed, logprobs=0,
                                 ignore_eos=True) for seed in seeds]
        outputs = self.call("generate", lambda: self.llm.generate(
            [TokensPrompt(prompt_token_ids=p, cache_salt=cache_salt) for p in prompts], params,
            lora_request=lora, use_tqdm=False))
        return [_completion_from_output(o.outputs[0]) for o in outputs]


def _completion_from_output(output: Any) -> Completion:
    token_ids = list(output.token_ids)
    logprobs = [float(step[tok].logprob) for step, tok in zip(output.logprobs or [], token_ids, strict=True)]
    spans = output.weight_versions or []
    return Completion(output_ids=token_ids, logprobs=logprobs, finish_reason=str(output.finish_reason),
                      weight_version=_versions([s.version for s in spans]), text=output.text or "")


def _versions(labels: Sequence[str]) -> str:
    """vLLM's weight-version spans of one answer as one string ("3", or "3+4" for a mix)."""
    return "+".join(dict.fromkeys(labels)) or "unknown"


class ServerBackend(Backend):
    """`vllm serve` over HTTP (JsonClient: failures come back as weightsync errors)."""

    def __init__(self, url: str, *, api_key: str | None, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.http = JsonClient(self.url, api_key=api_key, timeout_s=timeout_s)
        self._tokens_api: bool | None = None
        self._model: str | None = None
        self._loras: set[str] = set()

    @property
    def num_requests(self) -> int:
        return self.http.num_requests

    def rpc(self, method: str, request: str, *, timeout_s: float, margin_s: float = RPC_MARGIN_S) -> list[Any]:
        response = self.http.request("POST", "/collective_rpc", allow=(404, 500),
                                     json_body={"method": method, "args": [request], "timeout": timeout_s},
                                     timeout_s=timeout_s + margin_s)
        if response.status_code == 404:
            raise EngineError(self.url, "POST /collective_rpc: 404; start vLLM with VLLM_SERVER_DEV_MODE=1")
        if response.status_code == 500:
            raise EngineError(self.url, f"POST /collective_rpc {method}: 500 {response.text[:300]!r}; is it "
                              f"started with --worker-extension-cls {EXTENSION}?", status=500)
        body = response.json()
        results = body.get("results") if isinstance(body, dict) else None
        if not isinstance(results, list):
            raise EngineError(self.url, f"POST /collective_rpc {method}: unexpected answer {response.text[:200]!r}")
        return results

    def pause(self, mode: str, *, timeout_s: float) -> None:
        # "keep" promises the kept requests their KV; vLLM 0.32 would drop it (a reset with the
        # running requests preempted) unless told clear_cache=false
        params = {"mode": mode, **({"clear_cache": "false"} if mode == "keep" else {})}
        self.http.post("/pause", params=params, timeout_s=timeout_s)

    def resume(self, *, timeout_s: float) -> None:
        self.http.post("/resume", timeout_s=timeout_s)

    def reset_prefix_cache(self, *, preempt_running: bool, timeout_s: float) -> bool:
        params = {"reset_running_requests": "true" if preempt_running else "false"}
        return bool(self.http.post("/reset_prefix_cache", params=params, timeout_s=timeout_s).get("success", False))

    def set_weight_version(self, version: str, *, timeout_s: float) -> None:
        response = self.http.request("POST", "/update_weight_version", json_body={"new_version": version},
                                     allow=(404,), timeout_s=timeout_s)
        if response.status_code == 404:
            log.debug("%s has no /update_weight_version; answers carry no weight version", self.url)

    def add_lora(self, lora_name: str, path: str, *, timeout_s: float) -> None:
        response = self.http.request("POST", "/v1/load_lora_adapter", allow=(404,), timeout_s=timeout_s,
                                     json_body={"lora_name": lora_name, "lora_path": path, "load_inplace": True})
        if response.status_code == 404:
            raise EngineError(self.url, "POST /v1/load_lora_adapter: 404; start vLLM with --enable-lora and "
                              "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")
        self._loras.add(lora_name)

    def remove_lora(self, lora_name: str, *, timeout_s: float) -> None:
        response = self.http.request("POST", "/v1/unload_lora_adapter", json_body={"lora_name": lora_name},
                                     allow=(404,), timeout_s=timeout_s)
        self._loras.discard(lora_name)
        if response.status_code == 404:
            raise AdapterNotLoadedError(self.url, f"no adapter {lora_name!r} is loaded: {response.text[:200]}",
                                        status=404)

    def loaded_loras(self) -> list[str]:
        models = self.http.get("/v1/models").get("data") or []
        base = self.model
        return sorted(str(m["id"]) for m in models if m.get("id") != base)

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = str(self.http.get("/v1/models")["data"][0]["id"])
        return self._model

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float,
                 lora_name: str | None, seeds: list[int | None], cache_salt: str) -> list[Completion]:
        sampling: dict[str, Any] = {"max_tokens": max_new_tokens, "temperature": temperature, "logprobs": 0,
                                    "ignore_eos": True}
        per_prompt = [sampling if seed is None else {**sampling, "seed": seed} for seed in seeds]
        model = lora_name or self.model
        with ThreadPoolExecutor(max_workers=max(1, min(len(prompts), 16))) as pool:  # one batch in vLLM
            return list(pool.map(self._generate_one, prompts, per_prompt, [model] * len(prompts),
                                 [cache_salt] * len(prompts)))

    def _generate_one(self, prompt: list[int], sampling: dict[str, Any], model: str, cache_salt: str) -> Completion:
        if self._tokens_api is not False:
            response = self.http.request("POST", "/inference/v1/generate", allow=(403, 404),
                                         json_body={"token_ids": prompt, "sampling_params": sampling, "model": model,
                                                    "cache_salt": cache_salt})
            if response.status_code not in (403, 404):
                self._tokens_api = True
                choice = response.json()["choices"][0]
                token_ids = list(choice.get("token_ids") or [])
                content = (choice.get("logprobs") or {}).get("content") or []
                spans = choice.get("weight_versions") or []
                return Completion(output_ids=token_ids, logprobs=[float(c["logprob"]) for c in content],
                                  finish_reason=str(choice.get("finish_reason")),
                                  weight_version=_versions([str(s["version"]) for s in spans]))
            self._tokens_api = False  # no --enable-scale-out: the OpenAI route, without weight versions
        body = self.http.post("/v1/completions", {"model": model, "prompt": prompt, "return_token_ids": True,
                                                  "cache_salt": cache_salt, **sampling})
        choice = body["choices"][0]
        return Completion(output_ids=list(choice.get("token_ids") or []),
                          logprobs=[float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []],
                          finish_reason=str(choice.get("finish_reason")), weight_version="unknown",
                          text=str(choice.get("text", "")))

    def close(self) -> None:
        self.http.close()
