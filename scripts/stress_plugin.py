"""A pytest plugin for `scripts/stress.py`: runs every collected test `--stress-count`
times in one session and tallies each run.

Repetition is a parametrization (as pytest-repeat does it): test `t[abort]` becomes
`t[abort-stress0]` ... `t[abort-stress19]`, so module fixtures (a vLLM server, a
`weightsync serve`) start once for all rounds. `outcomes` maps every run's node id
to "passed", "failed" (any phase: setup, call or teardown) or "skipped".
"""

from __future__ import annotations

from typing import Any

import pytest

outcomes: dict[str, str] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--stress-count", type=int, default=1, help="run every collected test this many times")


@pytest.fixture
def _stress_round(request: pytest.FixtureRequest) -> int:
    return int(request.param)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    count = int(metafunc.config.getoption("stress_count"))
    if count > 1:
        metafunc.fixturenames.append("_stress_round")
        metafunc.parametrize("_stress_round", range(count), indirect=True, ids=lambda i: f"stress{i}")


def pytest_runtest_logreport(report: Any) -> None:
    if report.failed:
        outcomes[report.nodeid] = "failed"
    elif report.skipped and report.nodeid not in outcomes:
        outcomes[report.nodeid] = "skipped"
    elif report.when == "call" and report.passed:
        outcomes.setdefault(report.nodeid, "passed")
