"""A `vllm.LLM` whose engine core and only worker run in the trainer's process
(VLLM_ENABLE_V1_MULTIPROCESSING=0): one process cannot join a torch.distributed
group twice, so broadcast is refused when the `WeightSync` is built, naming why
and what works; shm pushes go through. Run in a child process (the setting is
process-wide)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_fixtures as vf

vf.require_vllm()
pytestmark = pytest.mark.vllm

HERE = Path(__file__).parent


def test_broadcast_is_refused_up_front_when_the_worker_shares_the_process(tmp_path: Path) -> None:
    model_dir = vf.make_model_dir(tmp_path)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent / "support"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(HERE / "vllm_single_process_main.py"), str(model_dir)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["transports"] == ["disk", "shm"]
    assert "cannot take mode='full' over transport='broadcast'; it supports ['disk', 'shm']" in out["broadcast"]
    assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in out["broadcast"]
    assert out["shm_verified"] is True
