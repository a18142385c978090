"""Child of test_vllm_single_process.py: a `vllm.LLM` whose engine core and only
worker run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the parent),
asked for a broadcast push and an shm push. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import vllm_fixtures as vf
import weightsync as ws
from weightsync.engines.vllm.worker import EXTENSION


def main(model_dir: Path) -> dict[str, object]:
    from vllm import LLM

    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    llm = LLM(model=str(model_dir), worker_extension_cls=EXTENSION,
              enforce_eager=True, seed=0, **vf.ENGINE_ARGS)
    engine = ws.VLLMEngine.from_llm(llm)
    out: dict[str, object] = {"transports": sorted(engine.transports)}
    trainer = vf.load_trainer(model_dir)
    vf.perturb(trainer, seed=5)
    try:
        ws.WeightSync([engine], transport="broadcast")
    except ValueError as e:
        out["broadcast"] = str(e)
    with ws.WeightSync([engine], transport="shm") as sync:
        report = sync.push(trainer, version=1)
    out["shm_verified"] = report.verified
    vf.assert_parity(engine, trainer)
    return out


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))), flush=True)
    os._exit(0)  # the in-process engine core's threads would hold the interpreter's exit
