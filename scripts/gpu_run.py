"""The driver of scripts/gpu_run.sh: the machine, every GPU test (one pytest session, with a
time limit), the GPU bench (scripts/gpu_bench.py), and `summary.json` under --out saying what
passed, failed and was skipped (with the reason). Exit status 1 if any test failed or errored,
or a step ran out of time."""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

GPU_TESTS = [
    "tests/gpu",  # every CUDA test: the trainer on the GPU, CUDA IPC for shm, NCCL's bound
    "tests/unit/test_digests.py",  # wsmix64 on CUDA equal to the CPU's
    "tests/unit/transports/test_cuda_ipc_handles.py",  # the IPC handle's encoding and refusals
    "tests/faults/test_collective_bounds.py",  # the bound's code path on gloo
]
PACKAGES = ["torch", "transformers", "peft", "fastapi", "uvicorn", "pydantic", "safetensors", "xxhash", "numpy",
            "pytest"]


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    for name in PACKAGES:
        try:
            info[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info[name] = None
    try:
        import torch

        info["cuda_available"] = torch.cuda.is_available()
        info["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["devices"] = [{"name": torch.cuda.get_device_name(i),
                                "uuid": str(torch.cuda.get_device_properties(i).uuid)}
                               for i in range(torch.cuda.device_count())]
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:
        info["torch_error"] = f"{type(e).__name__}: {e}"
    try:
        info["nvidia_smi"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                            timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        info["nvidia_smi"] = f"not run: {e}"
    return info


def run_tests(out: Path, timeout_s: float) -> dict[str, Any]:
    junit = out / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-s", "-p", "no:cacheprovider", "--durations=15",
           f"--junitxml={junit}", *GPU_TESTS]
    started = time.monotonic()
    with (out / "pytest.log").open("w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = None
    result: dict[str, Any] = {"command": " ".join(cmd[1:]), "exit_status": rc, "timed_out": rc is None,
                              "seconds": round(time.monotonic() - started, 1)}
    result.update(parse_junit(junit))
    return result


def parse_junit(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"cases": [], "counts": {}}
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, reason = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                reason = (child.get("message") or child.text or "")[:1500]
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), **({"reason": reason} if reason else {})})
    counts: dict[str, int] = {}
    for c in cases:
        counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
    return {"counts": counts, "cases": cases}


def run_bench(out: Path, timeout_s: float) -> dict[str, Any]:
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "scripts/gpu_bench.py"], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        return {"timed_out": True, "seconds": timeout_s, "stderr": str(e.stderr or "")[-2000:]}
    (out / "bench.log").write_text(done.stdout + "\n" + done.stderr)
    try:
        figures = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        figures = {"error": done.stderr[-2000:]}
    return {"exit_status": done.returncode, "seconds": round(time.monotonic() - started, 1), "figures": figures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tests-timeout-s", type=float, default=330.0)
    parser.add_argument("--bench-timeout-s", type=float, default=100.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    summary: dict[str, Any] = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine()}
    print(json.dumps(summary["machine"], indent=1), flush=True)
    summary["tests"] = run_tests(args.out, args.tests_timeout_s)
    print(f"tests: {summary['tests']['counts']} in {summary['tests']['seconds']}s "
          f"(exit {summary['tests']['exit_status']})", flush=True)
    summary["bench"] = run_bench(args.out, args.bench_timeout_s)
    print(f"bench: {json.dumps(summary['bench'])[:3000]}", flush=True)
    summary["seconds"] = round(time.monotonic() - started, 1)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    counts = summary["tests"]["counts"]
    bad = counts.get("failed", 0) + counts.get("error", 0) or summary["tests"]["timed_out"] \
        or summary["bench"].get("timed_out", False)
    print(f"summary: {args.out / 'summary.json'}; {'FAILED' if bad else 'ok'} in {summary['seconds']}s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
