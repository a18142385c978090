"""Run tests many times to catch the ones that pass or fail by chance (not in CI).

Every given pytest node id runs `--count` times in ONE pytest session (so a module's
vLLM server or `weightsync serve` starts once), through `stress_plugin.py`. Prints one
row per test (runs, passed, failed), the failing node ids, and ends with one JSON line.
Exit status 0 when every run passed, 1 otherwise.

    bash scripts/stress.sh                       # each pause-mode test 20 times
    bash scripts/stress.sh --count 50 tests/faults/test_load.py -- -x
    PYTHON=/other/venv/bin/python bash scripts/stress.sh ...   # that interpreter, no install
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter

import pytest
import stress_plugin

PAUSE_MODE_TESTS = (
    "tests/integration/test_vllm_server.py::test_pause_modes_lose_no_request",
    "tests/integration/test_server_pause.py::test_update_under_pause",
    "tests/faults/test_load.py::test_load_under_back_to_back_pushes",
)
"""The default: every test that pauses generation while requests run."""


def base_id(node_id: str) -> str:
    """A run's node id without its stress round: `t[abort-stress3]` -> `t[abort]`."""
    name, _, params = node_id.partition("[")
    kept = [p for p in params.rstrip("]").split("-") if not re.fullmatch(r"stress\d+", p)]
    return f"{name}[{'-'.join(kept)}]" if params and kept else name


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=f"{__doc__.split(chr(10) * 2, 2)[2]}arguments after -- go to pytest")
    parser.add_argument("--count", type=int, default=20, help="runs of each test (default 20)")
    parser.add_argument("node_ids", nargs="*", default=list(PAUSE_MODE_TESTS),
                        help="pytest node ids (default: the pause-mode tests)")
    ours, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser.parse_args(ours)
    if args.count < 1:
        parser.error(f"--count must be at least 1, got {args.count}")

    started = time.monotonic()
    pytest.main([*args.node_ids, "-q", "-p", "no:cacheprovider", "--stress-count", str(args.count), *extra],
                plugins=[stress_plugin])
    seconds = time.monotonic() - started

    per_test: dict[str, Counter[str]] = {}
    for node_id, outcome in stress_plugin.outcomes.items():
        per_test.setdefault(base_id(node_id), Counter())[outcome] += 1
    width = max((len(t) for t in per_test), default=10)
    print(f"\n{'test':<{width}}  runs  passed  failed  skipped")
    for test, counts in per_test.items():
        print(f"{test:<{width}}  {counts.total():>4}  {counts['passed']:>6}  {counts['failed']:>6}  "
              f"{counts['skipped']:>7}")
    totals = Counter(stress_plugin.outcomes.values())
    failing = {t: c["failed"] for t, c in per_test.items() if c["failed"]}
    print(f"{totals.total()} runs: {totals['passed']} passed, {totals['failed']} failed, "
          f"{totals['skipped']} skipped in {seconds:.0f}s" + (f"; failing: {', '.join(failing)}" if failing else ""))
    print(json.dumps({"runs": totals.total(), "passed": totals["passed"], "failed": totals["failed"],
                      "skipped": totals["skipped"], "count": args.count, "failing": failing,
                      "tests": {t: dict(c) for t, c in per_test.items()}, "seconds": round(seconds, 1)}))
    return 0 if totals.total() and totals["passed"] == totals.total() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
