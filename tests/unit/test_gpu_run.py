"""scripts/gpu_run.py, the prepared GPU run: it runs every test that needs CUDA (each file that
skips without it is on its list), and its summary names each test's outcome with the reason."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def gpu_run() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_run", ROOT / "scripts" / "gpu_run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_test_file_that_needs_cuda_is_in_the_prepared_run() -> None:
    listed = gpu_run().GPU_TESTS
    needle = "torch.cuda." + "is_available()"  # split, so this file is not among them
    needing = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if needle in p.read_text())
    assert needing, "no test checks for CUDA: the scan is broken"
    missing = [p for p in needing if p not in listed and not any(p.startswith(d + "/") for d in listed)]
    assert not missing, f"tests that need CUDA but scripts/gpu_run.py's GPU_TESTS leaves out: {missing}"


def test_the_summary_names_each_outcome_and_the_skip_reason(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.gpu.a" name="test_ok" time="1.5"/>'
        '<testcase classname="tests.gpu.a" name="test_skip" time="0">'
        '<skipped message="needs a CUDA device"/></testcase>'
        '<testcase classname="tests.gpu.a" name="test_bad" time="2"><failure message="assert 1 == 2">tb</failure>'
        '</testcase></testsuite></testsuites>')
    got = gpu_run().parse_junit(junit)
    assert got["counts"] == {"passed": 1, "skipped": 1, "failed": 1}
    assert got["cases"] == [
        {"test": "tests.gpu.a::test_ok", "outcome": "passed", "seconds": 1.5},
        {"test": "tests.gpu.a::test_skip", "outcome": "skipped", "seconds": 0.0, "reason": "needs a CUDA device"},
        {"test": "tests.gpu.a::test_bad", "outcome": "failed", "seconds": 2.0, "reason": "assert 1 == 2"},
    ]
