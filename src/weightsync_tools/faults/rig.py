"""The engine under test and the trainer's side of a fault scenario.

`Rig` runs one `weightsync serve` subprocess (restartable on the same port) and
keeps the trainer's record of what it should serve: the last acked weights and
version. Weights are plain dicts of tensors in Hugging Face naming, pushed
through `DictSource`; `make_fault_model` writes a tiny model whose greedy
answers identify the weights that computed them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import torch

from weightsync.engines.base import CLEANUP_TIMEOUT_S
from weightsync.engines.sglang import SGLangEngine
from weightsync.formats.version_dir import MANIFEST_FILE, bucket_file_name
from weightsync.integrity import digest
from weightsync.manifest import Manifest, TensorMeta
from weightsync.push.sync import WeightSync
from weightsync.server.launch import ServerProcess, launch_server
from weightsync.transports import make_transport
from weightsync.transports.base import Transport

POLICIES = ("none", "abort", "retract", "in_place")
BUCKET_BYTES = 64 << 10
"""Small buckets: the tiny model (1.7 MB) streams as 19 buckets, so a fault lands mid-stream."""
MARGIN_S = 15.0
"""Slack on every time bound, for a loaded 2-core machine; bounds detect hangs, they time nothing."""
SCHEDULING_MARGIN_S = 1.5
"""Slack on `failed_push_bound_s` where a test asserts the bound itself: what our own code
takes besides waiting out its timeouts (threads waking, a local round trip, closing the
transport) on a loaded 2-core machine. A bound on the library's latency, not a speed target."""
ADMIN_KEY = "faults-admin-key"
PROMPTS = ((5, 17, 42, 7), (300, 2, 99), (11, 12, 13, 14, 15, 16), (64, 65))
LOGPROB_TOLERANCE = 1e-3
"""An answer's logprobs match a version's weights within this; different versions differ by >0.01."""
_VERSION_DIR = re.compile(r"^v\d{8}$")
Weights = dict[str, torch.Tensor]


def failed_push_bound_s(timeout_s: float) -> float:
    """The README's bound on a push that fails because an engine stalled from its start:
    `timeout_s` for the call that stalled, then `min(timeout_s, CLEANUP_TIMEOUT_S)` for
    every cleanup round together (the stalled engine's own cleanup runs in the background)."""
    return timeout_s + min(CLEANUP_TIMEOUT_S, timeout_s)


def error_bound_s(timeout_s: float) -> float:
    """Longest a failing push may take before a scenario calls it hung: `failed_push_bound_s`
    plus `MARGIN_S`."""
    return failed_push_bound_s(timeout_s) + MARGIN_S


# -- the trainer's weights ---------------------------------------------------------------------


def load_weights(model_dir: Path) -> Weights:
    from safetensors.torch import load_file

    weights: Weights = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        weights.update(load_file(str(path)))
    return weights


def perturbed(weights: Weights, seed: int, scale: float = 0.05) -> Weights:
    """New weights: `weights` plus seeded noise (every tensor changes)."""
    gen = torch.Generator().manual_seed(seed)
    return {n: (t.float() + scale * torch.randn(t.shape, generator=gen)).to(t.dtype).contiguous()
            for n, t in weights.items()}


def digests_of(weights: Weights) -> dict[str, str]:
    return {n: digest(t.contiguous()) for n, t in weights.items()}


class DictSource:
    """A `WeightSource` over a dict of tensors, in the dict's order."""

    mode = "full"

    def __init__(self, weights: Weights) -> None:
        self.weights = weights

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta.of(n, t) for n, t in self.weights.items()]

    def tensors(self, hf_names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name in hf_names if hf_names is not None else list(self.weights):
            yield name, self.weights[name]


def make_fault_model(directory: Path) -> Path:
    """A tiny model with weights redrawn wide (logit std ~2): greedy decoding is far
    from ties, so an answer's tokens and logprobs identify the weights behind them."""
    from safetensors.torch import save_file

    from weightsync.tiny import make_tiny_model

    model_dir = make_tiny_model(directory)
    weights = load_weights(model_dir)
    gen = torch.Generator().manual_seed(1)
    for name, tensor in weights.items():
        if "norm" not in name:
            scale = 2.0 / tensor.shape[-1] ** 0.5 if tensor.dim() > 1 else 0.4
            weights[name] = (torch.randn(tensor.shape, generator=gen) * scale).to(tensor.dtype)
    for path in model_dir.glob("*.safetensors"):
        path.unlink()
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    return model_dir


# -- the engine under test ---------------------------------------------------------------------


class Rig:
    """One `weightsync serve` under test (restartable on the same port) and the
    trainer-side record of what it should serve: the last acked weights and version."""

    def __init__(self, model_dir: Path, root: Path, *, timeout_s: float = 3.0, session_timeout_s: float = 2.0,
                 group_timeout_s: float = 5.0, api_key: str | None = ADMIN_KEY) -> None:
        self.model_dir = Path(model_dir)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.timeout_s = timeout_s
        self.session_timeout_s = session_timeout_s
        self.api_key = api_key
        self.args = ["--disk-root", str(self.root), "--num-threads", "1",
                     "--session-timeout", str(session_timeout_s), "--group-timeout", str(group_timeout_s)]
        if api_key is not None:
            self.args += ["--admin-api-key", api_key]
        self.server: ServerProcess | None = None
        self.incarnation = 0
        """How many engine processes this rig has started (versions restart with each)."""
        self.weights: Weights = load_weights(self.model_dir)
        self.version = 0
        self._last_version = 0
        self._seeds = itertools.count(1000)

    # -- process -----------------------------------------------------------------------------

    def start(self, port: int | None = None) -> Rig:
        args = [*self.args, "--port", str(port)] if port is not None else self.args
        self.server = launch_server(self.model_dir, args=args)
        self.incarnation += 1
        self.weights, self.version = load_weights(self.model_dir), 0
        return self

    def restart(self) -> None:
        """Start the engine again on the same port and disk root (after `kill`)."""
        port = int(self.url.rsplit(":", 1)[1])
        assert self.server is not None
        self.server.close()
        self.start(port)

    def kill(self) -> None:
        assert self.server is not None
        self.server.kill()

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    def __enter__(self) -> Rig:
        return self.start() if self.server is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def url(self) -> str:
        assert self.server is not None, "start() first"
        return self.server.url

    @property
    def pid(self) -> int:
        assert self.server is not None, "start() first"
        return self.server.pid

    # -- talking to it -------------------------------------------------------------------------

    def engine(self) -> SGLangEngine:
        """Built as the README builds it: no timeout of its own, so the push's bounds every call."""
        return SGLangEngine(self.url, api_key=self.api_key)

    def sync(self, transport: str | Transport, *, disk_root: Path | None = None, engine: Any = None,
             timeout_s: float | None = None, **options: Any) -> WeightSync:
        """A trainer's sync; `transport` by name (its versions under `disk_root`, by default
        `self.disk_root(transport)`) or a transport object (`self.transport`, wrapped)."""
        if isinstance(transport, str):
            options["disk_root"] = str(disk_root or self.disk_root(transport))
        return WeightSync([engine or self.engine()], transport=transport, bucket_bytes=BUCKET_BYTES,
                          timeout_s=timeout_s or self.timeout_s, **options)

    def transport(self, name: str, *, disk_root: Path | None = None, timeout_s: float | None = None) -> Transport:
        """The transport `self.sync(name, ...)` would make, to wrap in a `FaultyTransport`."""
        return make_transport(name, timeout_s=timeout_s or self.timeout_s, disk_root=disk_root or self.disk_root(name))

    def disk_root(self, name: str) -> Path:
        """A directory under the engine's --disk-root for one trainer's versions."""
        return self.root / "versions" / name

    def info(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.url}/weightsync/info", timeout=30).json())

    def pause_generation(self, mode: str) -> int:
        """Pause generation (SGLang's modes); returns how many requests the pause affected."""
        return int(self._admin("/pause_generation", {"mode": mode})["num_paused_requests"])

    def continue_generation(self) -> None:
        self._admin("/continue_generation", {})

    def _admin(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key is not None else {}
        response = httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=30)
        response.raise_for_status()
        return dict(response.json())

    def served(self) -> tuple[int, dict[str, str]]:
        """(version, hf_name -> digest) of what the engine serves now."""
        body = httpx.post(f"{self.url}/weightsync/digests", json={"names": None}, timeout=30).json()
        return int(body["weight_version"]), dict(body["digests"])

    def expected(self) -> tuple[int, dict[str, str]]:
        """What the engine should serve: the last acked version and weights."""
        return self.version, digests_of(self.weights)

    def generates(self) -> int | None:
        """The weight version a short greedy request ran with, or None if it failed."""
        try:
            response = httpx.post(f"{self.url}/generate", timeout=60, json={
                "input_ids": list(PROMPTS[0]), "sampling_params": {"temperature": 0, "max_new_tokens": 2}})
        except httpx.HTTPError:
            return None
        if response.status_code != 200 or response.json()["meta_info"]["finish_reason"]["type"] != "length":
            return None
        return int(response.json()["meta_info"]["weight_versions"][-1]["weightsync_version"])

    def wait_healthy(self, timeout_s: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return True
            time.sleep(0.05)  # polling interval; /health decides
        return False

    # -- pushing -------------------------------------------------------------------------------

    def next_version(self) -> int:
        """A version newer than every one handed out so far (and than the served one)."""
        self._last_version = max(self._last_version, self.version) + 1
        return self._last_version

    def new_weights(self) -> Weights:
        return perturbed(self.weights, next(self._seeds))

    def accept(self, weights: Weights, version: int) -> None:
        self.weights, self.version = weights, version

    def push(self, sync: WeightSync) -> int:
        """A good push of fresh weights; returns its version."""
        version, weights = self.next_version(), self.new_weights()
        sync.push(DictSource(weights), version=version)
        self.accept(weights, version)
        return version


def version_dir_problems(root: Path) -> list[str]:
    """Version directories under `root` that are not complete (manifest + every bucket file)."""
    problems: list[str] = []
    if not root.is_dir():
        return problems
    for entry in sorted(root.iterdir()):
        if not _VERSION_DIR.match(entry.name):
            continue
        try:
            manifest = Manifest.from_json((entry / MANIFEST_FILE).read_bytes())
        except (OSError, ValueError) as e:
            problems.append(f"{entry.name}: {type(e).__name__}: {e}")
            continue
        problems += [f"{entry.name}: {bucket_file_name(b.index)} missing" for b in manifest.buckets
                     if not (entry / bucket_file_name(b.index)).is_file()]
    return problems


def leftover_temp_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob(".tmp-*")) if root.is_dir() else []
