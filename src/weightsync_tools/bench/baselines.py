"""How RL frameworks sync weights today (one request per tensor over broadcast or HTTP, checkpoint
then reload), measured against the same engine.

Runs against SGLang's own routes of `weightsync serve`, one begin/end session per push, timed from
the first byte to the engine's answer. Uses no weightsync bucketing, transport or coordinator code:
only the group rendezvous (`weightsync.formats.groups`), the tensor naming and a JSON client. Each
baseline: docs/PERFORMANCE.md ("How the bench measures").
"""

from __future__ import annotations

import base64
import pickle
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from weightsync.dtypes import dtype_name
from weightsync.engines.json_client import JsonClient
from weightsync.formats.groups import UpdateGroup, finish_hosting, host_group
from weightsync.modes import named_weights

BASELINES = ("per-tensor-broadcast", "per-tensor-http", "checkpoint-reload")


@dataclass(frozen=True, kw_only=True)
class BaselineResult:
    """One baseline run: seconds end to end, and where they went."""

    name: str
    """One of BASELINES."""
    num_bytes: int
    """Bytes of weights moved."""
    num_requests: int
    """HTTP requests made (update calls only)."""
    seconds: float
    """First byte to the engine's last answer."""
    parts: dict[str, float] = field(default_factory=dict)
    """Sub-steps in seconds (checkpoint-reload: save, load)."""

    @property
    def gbps(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "num_bytes": self.num_bytes, "num_requests": self.num_requests,
                "seconds": self.seconds, "gbps": self.gbps, "parts": dict(self.parts)}


@contextmanager
def _sglang_session(client: JsonClient) -> Iterator[None]:
    client.post("/begin_weight_update", {"selector": "all"})
    try:
        yield
    finally:
        client.post("/end_weight_update", {})


@contextmanager
def _update_group(client: JsonClient, timeout_s: float) -> Iterator[tuple[UpdateGroup, str]]:
    """A two-rank gloo group with the engine (this process is rank 0)."""
    group_name = f"baseline-{secrets.token_hex(4)}"
    holder, port = host_group(master_address="127.0.0.1", world_size=2, group_name=group_name,
                              backend="gloo", timeout_s=timeout_s)
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(client.post, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": group_name, "backend": "gloo"})
        group = finish_hosting(holder, timeout_s=timeout_s)
        joining.result(timeout=timeout_s)
    try:
        yield group, group_name
    finally:
        try:
            client.post("/destroy_weights_update_group", {"group_name": group_name}, timeout_s=10)
        finally:
            group.destroy()


def per_tensor_broadcast(client: JsonClient, model: nn.Module, version: int, *, timeout_s: float = 120.0,
                         ) -> BaselineResult:
    """One request + one broadcast per tensor, no buckets."""
    tensors = [(name, t.detach().contiguous()) for name, t in named_weights(model)]
    with _update_group(client, timeout_s) as (group, group_name), ThreadPoolExecutor(1) as pool:
        t0 = time.perf_counter()
        with _sglang_session(client):
            for name, tensor in tensors:
                answer = pool.submit(client.post, "/update_weights_from_distributed", {
                    "names": [name], "dtypes": [dtype_name(tensor.dtype)], "shapes": [list(tensor.shape)],
                    "group_name": group_name, "load_format": None, "flush_cache": False,
                    "weight_version": str(version)})
                group.broadcast(tensor, src=0, timeout_s=timeout_s)
                answer.result(timeout=timeout_s)
        seconds = time.perf_counter() - t0
    return BaselineResult(name="per-tensor-broadcast", num_bytes=_nbytes(tensors), num_requests=len(tensors),
                          seconds=seconds)


def per_tensor_http(client: JsonClient, model: nn.Module, version: int) -> BaselineResult:
    """One `/update_weights_from_tensor` request per tensor (pickle + base64 in JSON)."""
    tensors = [(name, t.detach().contiguous()) for name, t in named_weights(model)]
    t0 = time.perf_counter()
    with _sglang_session(client):
        for name, tensor in tensors:
            payload = base64.b64encode(pickle.dumps([(name, tensor)])).decode("ascii")
            client.post("/update_weights_from_tensor", {
                "serialized_named_tensors": [payload], "load_format": None, "flush_cache": False,
                "weight_version": str(version)})
    seconds = time.perf_counter() - t0
    return BaselineResult(name="per-tensor-http", num_bytes=_nbytes(tensors), num_requests=len(tensors),
                          seconds=seconds)


def checkpoint_reload(client: JsonClient, model: nn.Module, version: int, directory: Path) -> BaselineResult:
    """`save_pretrained` into `directory` (under the engine's disk root), then reload it."""
    shutil.rmtree(directory, ignore_errors=True)
    try:
        t0 = time.perf_counter()
        model.save_pretrained(directory)  # type: ignore[operator]
        t1 = time.perf_counter()
        client.post("/update_weights_from_disk", {"model_path": str(directory.resolve()),
                                                  "weight_version": str(version), "flush_cache": True})
        t2 = time.perf_counter()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return BaselineResult(name="checkpoint-reload", num_bytes=num_bytes, num_requests=1, seconds=t2 - t0,
                          parts={"save": t1 - t0, "load": t2 - t1})


def run_baselines(url: str, model: nn.Module, *, next_version: Callable[[], int], directory: Path,
                  names: tuple[str, ...] = BASELINES, timeout_s: float = 120.0) -> list[BaselineResult]:
    """Every baseline in `names` against the engine at `url`, each as a new version."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    client = JsonClient(url, timeout_s=timeout_s)
    results = []
    try:
        with torch.no_grad():
            for name in names:
                if name == "per-tensor-broadcast":
                    results.append(per_tensor_broadcast(client, model, next_version(), timeout_s=timeout_s))
                elif name == "per-tensor-http":
                    results.append(per_tensor_http(client, model, next_version()))
                elif name == "checkpoint-reload":
                    results.append(checkpoint_reload(client, model, next_version(), directory))
                else:
                    raise ValueError(f"unknown baseline {name!r}; one of {BASELINES}")
    finally:
        client.close()
    return results


def _nbytes(tensors: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)
