"""The whole test suite as two pytest sessions side by side (`bash scripts/test.sh` with no
arguments runs this; with arguments it runs one pytest session on them).

The suite is CPU-bound where engines start and idle where a test waits on its engine: the
two cores were 35-55% idle in the tests of `SECOND`, each waiting on its own `weightsync
serve`, Ray workers, gloo ranks or network-namespace hosts. They start no vLLM, and the time
they bound is a hang's (`faults.MARGIN_S`, 15 s of slack), so they run in a session of their
own beside the first: everything else, tests/unit first, the vLLM tests, and the fault tests
that check the README's bound itself with 1.5 s of slack (`faults.SCHEDULING_MARGIN_S`).
The first session's output streams here; the second's is printed when both have ended,
then one line with both sessions' counts. Exit status: 0 when both passed.

    python scripts/suite.py [PYTEST ARGS FOR BOTH SESSIONS]
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECOND = (
    "tests/multihost",
    "tests/distributed",
    "tests/frameworks/test_verl.py",
    "tests/integration/test_demo.py",
    "tests/integration/test_forkserver.py",
    "tests/integration/test_moe_serve.py",
    "tests/integration/test_moe_stacked.py",
    "tests/integration/test_moe_stock_sglang.py",
    "tests/integration/test_peer_clients.py",
    "tests/integration/test_server_bad_input.py",
    "tests/integration/test_server_control.py",
    "tests/integration/test_server_generate.py",
    "tests/integration/test_server_layouts.py",
    "tests/integration/test_server_lora.py",
    "tests/integration/test_server_pause.py",
    "tests/integration/test_server_relay.py",
    "tests/integration/test_server_stock_sglang.py",
    "tests/integration/test_server_torn_updates.py",
    "tests/integration/test_server_updates.py",
    "tests/integration/test_shm_adoption.py",
    "tests/integration/test_tcp_nodelay.py",
    "tests/unit/bench",
)
"""The second session: tests that start no vLLM and bound no time but a hang's (tests/conftest.py
fails any test of this session that would use a vLLM)."""
PART_ENV = "WEIGHTSYNC_SUITE_PART"
QUIET_OPENMP = {"OMP_WAIT_POLICY": "PASSIVE"}
"""For both sessions and every process they start (servers, vLLM, ranks, Ray workers): an
OpenMP thread with no work sleeps instead of spinning. The suite keeps more processes busy
than there are cores, and a spinning thread takes a core from another process: two
sessions' MoE `weightsync serve` tests took 32-35 s side by side with OpenMP's default
policy, 14 s with this one (2-core Intel Xeon). Threads per process are unchanged (torch's
default, as users run it)."""
COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def summary(output: str) -> dict[str, int]:
    """The counts of pytest's last line ("=== 3 passed, 1 skipped in 2.0s ===")."""
    lines = [line for line in output.splitlines() if COUNTS.search(line) and re.search(r" in [\d.]+s", line)]
    counts: dict[str, int] = {}
    for number, what in COUNTS.findall(lines[-1] if lines else ""):
        counts[what.rstrip("s") if what.startswith("error") else what] = int(number)
    return counts


def main(args: list[str]) -> int:
    missing = [path for path in SECOND if not (ROOT / path).exists()]
    if missing:
        print(f"suite.py: SECOND names paths that do not exist: {missing}", file=sys.stderr)
        return 2
    pytest = [sys.executable, "-m", "pytest"]
    first_cmd = [*pytest, "--durations=25", *(f"--ignore={path}" for path in SECOND), *args]
    second_cmd = [*pytest, "--durations=10", "-p", "no:cacheprovider", *SECOND, *args]
    started = time.monotonic()
    env = {**QUIET_OPENMP, **os.environ}  # a policy the caller set wins
    with tempfile.TemporaryFile(mode="w+") as second_log:
        second = subprocess.Popen(second_cmd, cwd=ROOT, stdout=second_log, stderr=subprocess.STDOUT,
                                  env={**env, PART_ENV: "second"})
        first = subprocess.Popen(first_cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 env={**env, PART_ENV: "first"})
        assert first.stdout is not None
        first_output = []
        for line in first.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            first_output.append(line)
        first_code = first.wait()
        second_code = second.wait()
        second_log.seek(0)
        second_output = second_log.read()
    print(f"\n{'=' * 30} the second session ({len(SECOND)} paths, side by side with the first) {'=' * 30}")
    print(second_output, end="")
    totals: dict[str, int] = {}
    for counts in (summary("".join(first_output)), summary(second_output)):
        for what, number in counts.items():
            totals[what] = totals.get(what, 0) + number
    print(f"\nboth sessions, {time.monotonic() - started:.0f} s of wall time (pytest exit codes {first_code} and "
          f"{second_code}):")
    order = ("passed", "failed", "skipped", "error", "xfailed", "xpassed", "deselected")
    print(", ".join(f"{totals.get(what, 0)} {what}" for what in order[:2]) +
          "".join(f", {totals[what]} {what}" for what in order[2:] if totals.get(what)))
    return 0 if first_code == second_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
