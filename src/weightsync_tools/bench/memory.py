"""Trainer peak memory of producing merged-LoRA weights: layer by layer (`MergedLoraSource`), the
whole model at once, and `deepcopy` + `merge_and_unload`.

The methods run one after another in one fresh child process, which resets the kernel's peak
resident set before each and reports that peak above the footprint just before it (each method
frees what it made). Linux only (reads /proc); measures memory, never time. How:
docs/PERFORMANCE.md ("How the bench measures").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any

from weightsync.process_memory import MemoryMark

METHODS = ("layer-by-layer", "whole-model", "merge-and-unload")
CHILD_TIMEOUT_S = 600.0


@dataclass(frozen=True, kw_only=True)
class MemoryResult:
    """Peak resident memory of one method, above the trainer model's own."""

    method: str
    """One of METHODS."""
    model_bytes: int
    """Bytes of the base weights."""
    base_rss_bytes: int
    """Resident set with the PEFT model built, before merging."""
    peak_extra_bytes: int
    """Peak resident set while merging, minus `base_rss_bytes`."""
    largest_tensor_bytes: int
    """The largest single weight (what layer-by-layer should be bounded by, times a few)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _merge(method: str, model: Any) -> None:
    import copy

    from weightsync.lora.source import MergedLoraSource

    if method == "layer-by-layer":
        for _, tensor in MergedLoraSource(model).tensors():
            del tensor
    elif method == "whole-model":
        merged = dict(MergedLoraSource(model).tensors())
        del merged
    elif method == "merge-and-unload":
        merged_model = copy.deepcopy(model).merge_and_unload()
        del merged_model
    else:
        raise ValueError(f"unknown method {method!r}; one of {METHODS}")


def _child(methods: list[str], scenario_json: str) -> list[dict[str, Any]]:
    """In the fresh process: build once; for each method, reset the peak, merge, report."""
    import torch

    from weightsync.tiny import TinyModelConfig, build_model
    from weightsync_tools.bench.scenarios import with_lora

    torch.set_num_threads(1)
    model = with_lora(build_model(TinyModelConfig(**json.loads(scenario_json))))
    base = model.get_base_model()
    model_bytes = sum(p.numel() * p.element_size() for n, p in base.named_parameters() if "lora_" not in n)
    largest = max(p.numel() * p.element_size() for p in base.parameters())
    results = []
    for method in methods:
        mark = MemoryMark.take()
        if mark is None:
            raise RuntimeError("this machine's /proc cannot reset or read the peak resident set (Linux only)")
        with torch.no_grad():
            _merge(method, model)
        figures = mark.since()
        assert figures is not None  # /proc was readable a moment ago
        results.append(MemoryResult(method=method, model_bytes=model_bytes, base_rss_bytes=mark.start_bytes,
                                    peak_extra_bytes=figures[0], largest_tensor_bytes=largest).to_dict())
    return results


def measure_all(model_config: dict[str, Any], methods: tuple[str, ...] = METHODS, *,
                timeout_s: float = CHILD_TIMEOUT_S) -> list[MemoryResult]:
    """Run each of `methods` on a model built from `model_config` (a TinyModelConfig as a dict), in
    that order, in one fresh process."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; one of {METHODS}")
    if not methods:
        return []
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "weightsync_tools.bench.memory", ",".join(methods),
                           json.dumps(model_config)],
                          capture_output=True, text=True, env=env, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"memory child ({', '.join(methods)}) failed with code {done.returncode}: "
                           f"{done.stderr[-2000:]}")
    return [MemoryResult(**r) for r in json.loads(done.stdout.strip().splitlines()[-1])]


def measure_memory(method: str, model_config: dict[str, Any], *, timeout_s: float = CHILD_TIMEOUT_S) -> MemoryResult:
    """`method` alone (`measure_all`)."""
    return measure_all(model_config, (method,), timeout_s=timeout_s)[0]


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1].split(","), sys.argv[2])))
