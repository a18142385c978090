"""The step loop and pause modes, with a fake runner (no model): what each mode
does to running and waiting requests, and that nothing steps while paused."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from weightsync.server.requests import (
    GenRequest,
    ServedVersion,
    parse_generate,
    stop_reason,
    to_response,
)
from weightsync.server.runner import StepOutcome, group_for_batching
from weightsync.server.sampling import SamplingParams
from weightsync.server.scheduler import Scheduler


class FakeRunner:
    """Appends token 7 per step. Each step takes one permit: with none left it blocks
    inside the step (holding the step lock), so tests decide exactly how far the loop gets."""

    def __init__(self) -> None:
        self.permits = threading.Semaphore(0)
        self.prefills: list[str] = []

    def step(self, requests: Sequence[GenRequest], *, served: ServedVersion) -> list[StepOutcome]:
        self.permits.acquire()
        outcomes = []
        for req in requests:
            if req.cache is None:
                self.prefills.append(req.rid)
                req.cache = "kv"
            req.output_ids.append(7)
            req.output_logprobs.append(-1.0)
            req.record_served(served)
            outcomes.append(StepOutcome(req, 7, stop_reason(req, 7, set(), self.decode)))
        return outcomes

    def run_freely(self) -> None:
        for _ in range(100_000):
            self.permits.release()

    def decode(self, ids: list[int]) -> str:
        return "x" * len(ids)


def make_request(rid: str, max_new_tokens: int) -> tuple[GenRequest, threading.Event]:
    done = threading.Event()
    req = GenRequest(rid=rid, prompt_ids=[1, 2], params=SamplingParams(temperature=0, max_new_tokens=max_new_tokens))
    req.on_done = lambda r: done.set()
    return req, done


def wait_for(predicate: Any) -> None:
    """Poll scheduler state (the state decides, not the clock)."""
    for _ in range(100_000):
        if predicate():
            return
        threading.Event().wait(0.0005)
    raise AssertionError("condition never held")


@pytest.fixture
def runner() -> FakeRunner:
    return FakeRunner()


@pytest.fixture
def scheduler(runner: FakeRunner) -> Iterator[Scheduler]:
    scheduler = Scheduler(runner, max_running=2, served=lambda: ServedVersion(3, "v3"))  # type: ignore[arg-type]
    scheduler.start()
    yield scheduler
    runner.run_freely()
    scheduler.stop()


def test_requests_finish_with_length_and_queue_beyond_max_running(scheduler: Scheduler,
                                                                    runner: FakeRunner) -> None:
    pairs = [make_request(f"r{i}", 5) for i in range(4)]
    for req, _ in pairs:
        scheduler.submit(req)
    runner.run_freely()
    for req, done in pairs:
        assert done.wait(10)
        assert req.finish_reason == {"type": "length", "length": 5}
        assert req.output_ids == [7] * 5 and [span.to_json() for span in req.spans] == [
            {"version": "v3", "start": 0, "end": 5, "weightsync_version": 3}]
    assert scheduler.is_idle()


def pause_mid_generation(scheduler: Scheduler, runner: FakeRunner, mode: str,
                         extra: GenRequest | None = None) -> tuple[list[GenRequest], int]:
    """Two requests running (one step done, the loop blocked inside the next), `extra`
    waiting; pause from another thread and let exactly the step in flight finish."""
    running = [make_request(f"run{i}", 1000)[0] for i in range(2)]
    for req in running:
        scheduler.submit(req)
    runner.permits.release()
    wait_for(lambda: all(req.output_ids for req in running))
    if extra is not None:
        scheduler.submit(extra)
    affected: list[int] = []
    pausing = threading.Thread(target=lambda: affected.append(scheduler.pause(mode)))
    pausing.start()
    wait_for(lambda: scheduler.interrupts_pending == 1)
    runner.permits.release()  # the step in flight completes; no new one starts
    pausing.join(10)
    assert [len(req.output_ids) for req in running] == [2, 2]
    return running, affected[0]


def test_abort_finishes_running_and_waiting(scheduler: Scheduler, runner: FakeRunner) -> None:
    waiting, _ = make_request("w", 3)
    running, affected = pause_mid_generation(scheduler, runner, "abort", extra=waiting)
    assert affected == 3
    for req in [*running, waiting]:
        assert req.finish_reason is not None and req.finish_reason["type"] == "abort"
    late, late_done = make_request("late", 2)
    scheduler.submit(late)
    assert not late_done.is_set() and scheduler.num_waiting == 1  # paused: it waits, is not rejected
    scheduler.resume()
    runner.run_freely()
    assert late_done.wait(10) and late.finish_reason == {"type": "length", "length": 2}


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_retract_drops_kv_and_in_place_keeps_it(scheduler: Scheduler, runner: FakeRunner, mode: str) -> None:
    running, affected = pause_mid_generation(scheduler, runner, mode)
    assert affected == 2
    assert all(req.cache is (None if mode == "retract" else "kv") for req in running)
    scheduler.cancel(running[1], "test")  # the loop is idle while paused
    runner.prefills.clear()
    scheduler.resume()
    first = running[0]
    runner.permits.release()
    wait_for(lambda: len(first.output_ids) == 3)
    cancelling = threading.Thread(target=scheduler.cancel, args=(first, "test done"))
    cancelling.start()
    wait_for(lambda: scheduler.interrupts_pending == 1)
    runner.permits.release()
    cancelling.join(10)
    assert first.finish_reason == {"type": "abort", "message": "test done"}
    if mode == "retract":
        assert runner.prefills == [first.rid]  # recomputed from prompt + generated tokens
    else:
        assert runner.prefills == []  # kept its KV cache


def test_group_for_batching_needs_equal_lengths_and_adapter() -> None:
    def req(rid: str, prompt: list[int], out: list[int], cached: bool, adapter: str | None = None) -> GenRequest:
        r = GenRequest(rid=rid, prompt_ids=prompt, params=SamplingParams(), adapter_name=adapter,
                       output_ids=list(out), cache="kv" if cached else None)
        return r

    a = req("a", [1, 2, 3], [4], True)
    b = req("b", [5, 6, 7], [8], True)
    c = req("c", [5, 6, 7], [8], True, adapter="x")
    d = req("d", [1, 2], [3, 4], True)  # same total length, same cache length as a and b
    e = req("e", [1, 2, 3, 4], [], False)  # prefill of 4 tokens
    groups = group_for_batching([a, b, c, d, e])
    assert [[r.rid for r in g] for g in groups] == [["a", "b", "d"], ["c"], ["e"]]
    assert group_for_batching([a, b], batchable=False) == [[a], [b]]


def encode_chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_answer_spans_split_where_the_version_or_the_label_changed() -> None:
    req, _ = make_request("r", 5)
    req.finish({"type": "length", "length": 5})
    current = ServedVersion(7, "v7")
    assert to_response(req, current=current)["meta_info"]["weight_versions"] == [
        {"version": "v7", "start": 0, "end": 0, "weightsync_version": 7}]  # never ran: the current weights
    steps = [ServedVersion(3, "v1"), ServedVersion(3, "v1"), ServedVersion(4, "v1"), ServedVersion(4, "step_10"),
             ServedVersion(4, "step_10")]
    for served in steps:
        req.output_ids.append(0)
        req.record_served(served)
    meta = to_response(req, current=current)["meta_info"]
    assert meta["weight_version"] == "step_10"
    assert meta["weight_versions"] == [
        {"version": "v1", "start": 0, "end": 2, "weightsync_version": 3},
        {"version": "v1", "start": 2, "end": 3, "weightsync_version": 4},  # same label, new weights
        {"version": "step_10", "start": 3, "end": 5, "weightsync_version": 4},  # new label, same weights
    ]


def test_parse_generate_single_and_batch() -> None:
    items, batch = parse_generate({"input_ids": [1, 2], "sampling_params": {"temperature": 0}}, encode=encode_chars)
    assert not batch and items[0].prompt_ids == [1, 2] and items[0].params.greedy
    items, batch = parse_generate({"input_ids": [[1], [2, 3]], "lora_path": ["a", None], "rid": ["x", "y"],
                                   "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]},
                                  encode=encode_chars)
    assert batch and [i.adapter_name for i in items] == ["a", None] and [i.rid for i in items] == ["x", "y"]
    assert [i.params.max_new_tokens for i in items] == [1, 2]
    with pytest.raises(ValueError, match="exactly one"):
        parse_generate({}, encode=encode_chars)
    with pytest.raises(ValueError, match="2 entries for 3 prompts"):
        parse_generate({"input_ids": [[1], [2], [3]], "rid": ["a", "b"]}, encode=encode_chars)
    with pytest.raises(ValueError, match="input_ids"):
        parse_generate({"input_ids": [1, "x"]}, encode=encode_chars)


def test_stop_reasons() -> None:
    def decode(ids: list[int]) -> str:
        return "".join(chr(96 + i) for i in ids)

    params = SamplingParams(max_new_tokens=5, stop=("cd",), stop_token_ids=(9,))
    req: Any = GenRequest(rid="r", prompt_ids=[1], params=params, output_ids=[3, 4])
    assert stop_reason(req, 4, {0}, decode) == {"type": "stop", "matched": "cd"}
    req.output_ids = [1, 9]
    assert stop_reason(req, 9, {0}, decode) == {"type": "stop", "matched": 9}
    req.output_ids = [1, 0]
    assert stop_reason(req, 0, {0}, decode) == {"type": "stop", "matched": 0}
    req.params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    assert stop_reason(req, 0, {0}, decode) == {"type": "length", "length": 2}


def test_a_pause_named_by_an_earlier_resume_is_not_applied(scheduler: Scheduler, runner: FakeRunner) -> None:
    """Its caller gave up waiting and resumed; the pause came after: not applied."""
    scheduler.resume(pause_id="p1")
    assert scheduler.pause("retract", pause_id="p1") == 0 and scheduler.paused is None
    runner.run_freely()
    req, done = make_request("r1", 2)
    scheduler.submit(req)
    assert done.wait(30) and req.output_ids == [7, 7]
    scheduler.pause("retract", pause_id="p2")
    assert scheduler.paused == "retract"
    scheduler.resume(pause_id="p2")
    assert scheduler.paused is None


def test_a_held_loop_steps_nothing_and_a_refusal_finishes_every_request(runner: FakeRunner) -> None:
    """A streamed commit's states (`hold`, `refusal`): held, requests wait and `on_held` is
    called; refused, running and waiting requests finish with the reason, none steps."""
    state: dict[str, str | None] = {"hold": "streamed update v4 is loading", "refusal": None}
    held_calls = threading.Event()
    scheduler = Scheduler(runner, max_running=1, served=lambda: ServedVersion(3, "v3"),  # type: ignore[arg-type]
                          hold=lambda: state["hold"], refusal=lambda: state["refusal"], on_held=held_calls.set)
    scheduler.start()
    try:
        req, done = make_request("r", 3)
        scheduler.submit(req)
        runner.run_freely()
        assert held_calls.wait(10)  # held with a request waiting: on_held, no step
        assert not done.is_set() and not req.output_ids and scheduler.num_steps == 0
        with scheduler.between_steps():
            state["hold"], state["refusal"] = None, "this server refuses to generate: v4 stopped"
        assert done.wait(10) and req.finish_reason is not None
        assert req.finish_reason["type"] == "abort" and "refuses to generate" in req.finish_reason["message"]
        assert not req.output_ids and scheduler.num_steps == 0
        with scheduler.between_steps():
            state["refusal"] = None
        again, again_done = make_request("again", 2)
        scheduler.submit(again)
        assert again_done.wait(10) and again.finish_reason == {"type": "length", "length": 2}
    finally:
        scheduler.stop()
