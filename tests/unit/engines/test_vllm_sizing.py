"""Every vLLM that weightsync's launcher or the suite starts gets its KV cache in bytes, never as
a fraction of the machine (issue 49: on a VM whose NUMA node held 10 GiB of /proc/meminfo's 23.5,
`--gpu-memory-utilization 0.05` gave vLLM less than a worker's RSS and every `vllm serve` died at
start). vLLM on CPU reads a fraction as a share of the NUMA node's memory
(`vllm/v1/worker/cpu_worker.py`); an explicit size it only checks against the node's free memory."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import vllm_shared_server
import vllm_support
from weightsync.engines.vllm.launch import DEFAULT_KV_CACHE_BYTES, server_command

ROOT = Path(__file__).resolve().parents[3]
FRACTION = re.compile(r"gpu[-_]memory[-_]utilization")
PASSES_THROUGH = {"src/weightsync/engines/vllm/launch.py"}
"""The one place a fraction may appear: the launcher passes a caller's own flag through."""


def kv_flags(command: list[str]) -> dict[str, str]:
    """The KV-sizing flags of a command line and their values."""
    return {flag: command[i + 1] for i, flag in enumerate(command)
            if flag in ("--kv-cache-memory-bytes", "--gpu-memory-utilization")}


def test_the_launcher_sizes_the_kv_cache_in_bytes_by_default() -> None:
    command = server_command("/model", port=1, env={})
    assert kv_flags(command) == {"--kv-cache-memory-bytes": str(DEFAULT_KV_CACHE_BYTES)}
    assert DEFAULT_KV_CACHE_BYTES == 1 << 30


def test_a_size_the_caller_gives_is_the_only_one() -> None:
    assert kv_flags(server_command("/model", port=1, env={}, args=["--kv-cache-memory-bytes", "8G"])) == {
        "--kv-cache-memory-bytes": "8G"}
    # A fraction the caller passes goes through alone (the launcher adds no bytes that would override it).
    assert kv_flags(server_command("/model", port=1, env={}, args=["--gpu-memory-utilization=0.3"])) == {}
    assert "--gpu-memory-utilization=0.3" in server_command("/model", port=1, env={},
                                                            args=["--gpu-memory-utilization=0.3"])
    # vLLM's own variable (GiB) overrides any flag in vLLM; the launcher then adds none.
    assert kv_flags(server_command("/model", port=1, env={"VLLM_CPU_KVCACHE_SPACE": "4"})) == {}


@pytest.mark.vllm
def test_vllm_reads_the_launchers_size_as_bytes() -> None:
    """vLLM's own parser turns the launcher's flag into `kv_cache_memory_bytes`, the explicit
    size its CPU worker takes instead of a share of the node."""
    vllm_support.require_vllm()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    command = server_command("/model", port=1, env={})
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args, _ = parser.parse_known_args(command[command.index("--model"):])
    assert EngineArgs.from_cli_args(args).kv_cache_memory_bytes == DEFAULT_KV_CACHE_BYTES


def test_the_suites_vllms_are_sized_in_bytes() -> None:
    size = str(vllm_support.KV_CACHE_BYTES)
    assert vllm_support.ENGINE_ARGS["kv_cache_memory_bytes"] == vllm_support.KV_CACHE_BYTES  # in-process LLMs
    assert kv_flags(vllm_support.server_args()) == {"--kv-cache-memory-bytes": size}  # the float32 vllm serve
    for module_args in ([], ["--dtype", "bfloat16", "--max-model-len", "1024"]):  # bf16 and module servers
        assert kv_flags(vllm_shared_server.with_kv_bytes(module_args)) == {"--kv-cache-memory-bytes": size}
    assert vllm_support.KV_CACHE_BYTES <= 512 << 20  # a tiny model's cache, whatever the machine


def test_no_fraction_reaches_vllm_anywhere() -> None:
    """No source in src/ or tests/ sizes vLLM by a fraction (the launcher only passes a caller's through)."""
    offenders = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
                 for tree in ("src", "tests") for path in sorted((ROOT / tree).rglob("*.py"))
                 if str(path.relative_to(ROOT)) not in PASSES_THROUGH and path != Path(__file__).resolve()
                 for number, line in enumerate(path.read_text().splitlines(), 1) if FRACTION.search(line)]
    assert not offenders, "\n".join(offenders)
