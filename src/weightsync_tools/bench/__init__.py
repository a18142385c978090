"""Benchmarks behind `weightsync bench`.

Sync suite: `scenarios` (model shapes by bytes), `limits` (the machine's own
copy / gloo / xxh3 / TCP / disk rates for the same bytes), `engines` (start
and stop the engines), `matrix` (WeightSync.push per mode x transport x
engine x bucket size), `fixed_cost` (seconds and HTTP round trips of a push
that moves almost nothing), `baselines` (how RL frameworks sync today),
`memory` (trainer peak memory of merged LoRA), `suite` (runs them all),
`analysis` (fractions, speed-ups, targets) and `report` (table, chart, JSON).
Beside it, `engine_memory` (each engine's peak and kept memory of a push, from its ack
and from the Pss of its processes), `quantized` (bf16, int8 and fp8 pushes of one model) and the
sparse and per-tensor suites.
The fault suite is the sibling package `weightsync_tools.faults`. Importing this
package imports none of them.
"""

from collections.abc import Callable

Progress = Callable[[str], None]
"""How a suite reports what it is doing, a line at a time (the CLI prints to stderr)."""
