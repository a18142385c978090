"""A vLLM scheduler for tests that holds requests mid-decode at a token count they ask for.

Loaded by the vLLM server the pause-mode tests start (`--scheduler-cls
vllm_freezing_scheduler.FreezingScheduler`, this directory on PYTHONPATH); it
runs inside vLLM's engine core, so it acts between two steps with no call
from outside. vLLM's scheduler otherwise: requests without the arguments
below are scheduled as usual.

A request asks for it with sampling params `extra_args={"freeze_id": ID,
"freeze_requests": N, "freeze_at_token": K}`. Sent while generation is paused
(`/pause?mode=keep&clear_cache=false`), the N requests with that ID (an n=N
request's sequences count one each) stay queued until the last arrives, then
generation resumes and admits them in one step, so they decode in lockstep;
once every one of them has K output tokens, generation pauses again exactly as
`/pause?mode=keep&clear_cache=false` does (requests keep their tokens and KV
blocks, nothing is scheduled until `/resume` or another pause mode). Each ID
freezes once. Why: against a server that decodes on its own, a pause sent by
the test lands at a moment the test does not control (seconds late on a
loaded 2-core machine, when vLLM's API server lags behind its engine).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler


def _spec(request: Any) -> tuple[str, int, int] | None:
    """(freeze_id, freeze_requests, freeze_at_token) if the request asked to be frozen."""
    extra = (request.sampling_params.extra_args or {}) if request.sampling_params is not None else {}
    if "freeze_id" not in extra:
        return None
    return str(extra["freeze_id"]), int(extra["freeze_requests"]), int(extra["freeze_at_token"])


class FreezingScheduler(Scheduler):
    """vLLM's scheduler, plus the freeze described in the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._arrived: Counter[str] = Counter()
        self._frozen: set[str] = set()

    def add_request(self, request: Any) -> None:
        super().add_request(request)
        spec = _spec(request)
        if spec is not None:
            freeze_id, num_requests, _ = spec
            self._arrived[freeze_id] += 1
            if self._arrived[freeze_id] == num_requests:  # all queued: admit them together
                self.set_pause_state(PauseState.UNPAUSED)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        counts: dict[str, list[int]] = {}
        for request in self.running:
            spec = _spec(request)
            if spec is not None and spec[0] not in self._frozen:
                counts.setdefault(spec[0], []).append(request.num_output_tokens)
                if len(counts[spec[0]]) == spec[1] and min(counts[spec[0]]) >= spec[2]:
                    self._frozen.add(spec[0])
                    self.set_pause_state(PauseState.PAUSED_ALL)
        return outputs
