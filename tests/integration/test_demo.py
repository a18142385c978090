"""The main job, end to end: `weightsync demo` learns, and every push is verified."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from weightsync.cli.main import main
from weightsync_tools.demo import DemoConfig, run_demo


def test_default_demo_learns_with_every_push_verified(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--out", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["config"]["mode"] == "lora" and report["config"]["transport"] == "http"
    assert len(report["steps"]) == 30 and report["all_verified"]
    assert report["reward_end"] > report["reward_start"] + 0.3, "the policy learned the task"
    assert report["max_logprob_gap"] < 1e-3, "engine and trainer compute the same logprobs"
    versions = [s["engine_versions"] for s in report["steps"]]
    assert versions == [[str(step)] for step in range(1, 31)], "rollouts of step k ran on version k"
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "demo.json").read_text())["steps"] == report["steps"]


@pytest.mark.parametrize(("mode", "transport"), [("full", "broadcast"), ("lora-merged", "shm"), ("lora", "disk")])
def test_demo_modes_and_transports(mode: str, transport: str, tmp_path: Path) -> None:
    result = run_demo(DemoConfig(steps=3, mode=mode, transport=transport, out_dir=tmp_path))
    assert [r.version for r in result.rows] == [2, 3, 4]
    assert all(r.verified for r in result.rows)
    assert max(r.logprob_gap for r in result.rows) < 1e-3


def test_the_trainer_leaves_the_embedded_engine_a_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the embedded engine (one torch thread) on this host, the trainer runs on the cores it
    leaves, and gets its own thread count back after; with vLLM it keeps what it had."""
    from weightsync_tools.demo.run import trainer_threads_beside

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)))
    before = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        with trainer_threads_beside(DemoConfig()):
            assert torch.get_num_threads() == 3
        assert torch.get_num_threads() == 8
        with trainer_threads_beside(DemoConfig(engine="vllm")):
            assert torch.get_num_threads() == 8
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
        with trainer_threads_beside(DemoConfig()):
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
