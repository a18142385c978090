"""`weightsync demo`: a tiny GRPO-style RL loop that syncs weights every step."""

from weightsync_tools.demo.run import DemoConfig, DemoResult, StepRow, run_demo

__all__ = ["DemoConfig", "DemoResult", "StepRow", "run_demo"]
