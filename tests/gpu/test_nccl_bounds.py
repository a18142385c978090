"""NCCL's first collective bounded by `timeout_s` (`formats.groups._bounded`): NCCL builds its
communicator inside the first broadcast, blocking until every rank arrives, where no
`Work.wait(timeout)` reaches (seen on an H200 before the bound: over 70 s with timeout_s=60).
Runs where CUDA is present; skipped, with the reason, everywhere else. Not yet run on a GPU.
The trainer runs in a child process that leaves with `os._exit`: a communicator build left
blocked on its thread must not hold up this session's exit. The same code path on gloo:
tests/faults/test_collective_bounds.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TIMEOUT_S = 10.0
HANG_GUARD_S = 30.0

TRAINER = """
import json, os, sys, time
from weightsync.errors import SyncTimeoutError, WeightSyncError
from weightsync.transports.broadcast import BroadcastTransport
timeout_s = float(sys.argv[1])
out = {}
transport = BroadcastTransport(device="cuda", timeout_s=timeout_s)
out["backend"] = transport.backend
transport.open([1], max_bucket_bytes=1 << 20)  # rank 1 never joins
started = time.monotonic()
try:
    transport.establish()  # NCCL forms lazily: this returns, the first broadcast blocks
    buffer = transport.slot(0, 1 << 20)
    transport.send(None, buffer)
    out["error"] = None
except WeightSyncError as e:
    out["error"], out["message"] = type(e).__name__, str(e)
out["seconds"] = time.monotonic() - started
group = transport._group
if group is not None:
    try:
        group.broadcast(buffer, timeout_s=timeout_s)
        out["after"] = None
    except WeightSyncError as e:
        out["after"] = str(e)
started = time.monotonic()
transport.close()
out["close_seconds"] = time.monotonic() - started
print(json.dumps(out), flush=True)
os._exit(0)
"""


def test_nccls_first_broadcast_with_a_peer_that_never_joins_returns_within_timeout_s() -> None:
    done = subprocess.run([sys.executable, "-c", TRAINER, str(TIMEOUT_S)], capture_output=True, text=True,
                          timeout=TIMEOUT_S + 2 * HANG_GUARD_S)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\nNCCL, a peer that never joins: {out}")
    assert out["backend"] == "nccl"
    assert out["error"] == "SyncTimeoutError" and "did not f" in out["message"], out  # did not form / finish
    assert out["seconds"] < TIMEOUT_S + HANG_GUARD_S, out
    if "after" in out:  # the group is broken for good: the next call is refused at once
        assert out["after"] is not None and "the group is unusable" in out["after"], out
    assert out["close_seconds"] < HANG_GUARD_S, out
