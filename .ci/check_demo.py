"""Check the JSON report of a short `weightsync demo --json` run (read from stdin).

What holds after a few steps, whatever the machine's speed: every push was
verified, the rollouts of step k ran on version k, the engine and the trainer
computed the same logprobs. (Learning shows only over more steps; the test
suite's demo test checks it over 30.) No timing is checked.

    bash scripts/demo.sh --steps 5 --json | python3 .ci/check_demo.py 5
"""

from __future__ import annotations

import json
import sys


def problems(report: dict, steps: int) -> list[str]:
    found = []
    rows = report.get("steps", [])
    if len(rows) != steps:
        found.append(f"{len(rows)} steps reported, expected {steps}")
    if not report.get("all_verified") or not all(r.get("verified") for r in rows):
        found.append("not every push was verified: " + str([r.get("verified") for r in rows]))
    versions = [r.get("engine_versions") for r in rows]
    if versions != [[str(step)] for step in range(1, len(rows) + 1)]:
        found.append(f"rollouts of step k did not all run on version k: {versions}")
    gap = report.get("max_logprob_gap")
    if not isinstance(gap, (int, float)) or not gap < 1e-3:
        found.append(f"engine and trainer logprobs differ: max gap {gap}")
    if not all(0.0 <= r.get("reward", -1) <= 1.0 for r in rows):
        found.append("a reward outside [0, 1]: " + str([r.get("reward") for r in rows]))
    return found


def main() -> int:
    steps = int(sys.argv[1])
    lines = sys.stdin.read().strip().splitlines()
    if not lines:
        print("check_demo: the demo printed no JSON report", file=sys.stderr)
        return 1
    report = json.loads(lines[-1])
    found = problems(report, steps)
    for problem in found:
        print(f"check_demo: {problem}", file=sys.stderr)
    if not found:
        print(f"check_demo: {steps} pushes, all verified, rollouts on the pushed versions, "
              f"max logprob gap {report['max_logprob_gap']:.2e}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
