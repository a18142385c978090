"""`python -m weightsync_tools.faults child SPEC_JSON`: a trainer process the faults
suite can kill mid-push (see `inject.child_main`)."""

from __future__ import annotations

import json
import sys

from weightsync_tools.faults.inject import child_main

if len(sys.argv) == 3 and sys.argv[1] == "child":
    sys.exit(child_main(json.loads(sys.argv[2])))
print("usage: python -m weightsync_tools.faults child SPEC_JSON (run by the faults suite)", file=sys.stderr)
sys.exit(2)
