"""Child of test_vllm_single_process.py: a `vllm.LLM` whose engine core and only
worker run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the parent),
serving a W8A8 (int8) checkpoint in bfloat16, asked for a broadcast push and for
shm pushes of two sets of float32 weights in turn, then a sparse one. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import vllm_fixtures as vf
import weightsync as ws
from weightsync.engines.vllm.worker import EXTENSION


def _served(engine: ws.VLLMEngine) -> list[tuple[list[int], list[float]]]:
    return [(c.output_ids, c.logprobs) for c in engine.generate(vf.PROMPTS, max_new_tokens=vf.MAX_NEW_TOKENS)]


def main(model_dir: Path, float_dir: Path) -> dict[str, Any]:
    from vllm import LLM

    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    llm = LLM(model=str(model_dir), worker_extension_cls=EXTENSION, enforce_eager=True, seed=0, dtype="bfloat16",
              max_model_len=1024, kv_cache_memory_bytes=vf.ENGINE_ARGS["kv_cache_memory_bytes"])
    engine = ws.VLLMEngine.from_llm(llm)
    quantization = engine.capabilities(30.0).quantization
    out: dict[str, Any] = {"transports": sorted(engine.transports),
                           "format": None if quantization is None else quantization.format.kind}
    fresh = _served(engine)  # a fresh load of the checkpoint's bytes
    try:
        ws.WeightSync([engine], transport="broadcast")
    except ValueError as e:
        out["broadcast"] = str(e)
    checkpoints = vf.load_trainer(float_dir)  # the float32 weights the checkpoint was quantized from
    other = vf.load_trainer(float_dir)
    vf.perturb(other, seed=5)
    out["pushes"] = []
    with ws.WeightSync([engine], transport="shm") as sync:
        for version, model in enumerate((other, checkpoints, other, checkpoints), start=1):
            report = sync.push(model, version=version)
            info = engine.info()
            out["pushes"].append({"weights": "checkpoint" if model is checkpoints else "other",
                                  "verified": report.verified, "fresh": _served(engine) == fresh,
                                  "probed": info["probed"], "dirty": info["dirty"]})
    with ws.WeightSync([engine], transport="shm", mode="sparse") as sync:  # the worker refuses sparse (409)
        report = sync.push(checkpoints, version=len(out["pushes"]) + 1)
    out["sparse"] = {"mode": report.mode, "verified": report.verified, "fresh": _served(engine) == fresh}
    probe = ws.probe_logprobs(checkpoints, engine, vf.PROMPTS, max_new_tokens=8)  # the last push's weights
    out["probe"] = {"quantized": probe.quantized, "max_gap": probe.max_gap, "trainer_max_gap": probe.trainer_max_gap,
                    "num_tokens": probe.num_tokens}
    return out


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]))), flush=True)
    os._exit(0)  # the in-process engine core's threads would hold the interpreter's exit
