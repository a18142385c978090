"""Load under pushes: concurrent generate clients while pushes run back to back,
and a replay that proves which whole weight versions computed every answer.
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

from weightsync_tools.faults.rig import LOGPROB_TOLERANCE, PROMPTS, Rig, Weights

# -- load: generation while pushes run back to back ---------------------------------------------


@dataclass
class LoadFigures:
    """Generate requests under back-to-back pushes with one pause policy."""

    policy: str
    transport: str
    clients: int
    pushes: int = 0
    held: int = 0
    """Requests held mid-decode when the pushes began (at least one per push)."""
    sent: int = 0
    completed: int = 0
    aborted: int = 0
    failed: int = 0
    spanning: int = 0
    """Completed answers that ran on two or more versions (allowed except under abort)."""
    torn: int = 0
    """Answers no sequence of whole pushed versions reproduces (must be 0)."""
    errors: list[str] = field(default_factory=list)

    @property
    def lost(self) -> int:
        return self.sent - self.completed - self.aborted - self.failed

    def summary(self) -> dict[str, Any]:
        return {"policy": self.policy, "transport": self.transport, "clients": self.clients, "pushes": self.pushes,
                "held": self.held, "sent": self.sent, "completed": self.completed, "aborted": self.aborted,
                "failed": self.failed, "lost": self.lost, "spanning": self.spanning, "torn": self.torn}


@dataclass(frozen=True)
class Answer:
    prompt: tuple[int, ...]
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish: str


PUSH_TIMEOUT_S = 60.0
"""timeout_s of the pushes under load: generous, so a push slowed by the load (or by a
busy machine) is never failed as a stall; the fault tests prove the timeouts."""


def run_load(rig: Rig, policy: str, *, transport: str = "http", num_clients: int = 3, num_pushes: int = 4,
             max_new_tokens: int = 16) -> LoadFigures:
    """`num_clients` loopback clients send greedy requests back to back while `num_pushes`
    pushes run, then one request more each; then every answer is checked.

    Each push starts with requests held mid-decode (`_hold_running`), so its pause (or,
    under "none", its commit) surely lands on running requests; generation resumes after
    it. The clients' last requests are sent after the last push, so they complete."""
    figures = LoadFigures(policy=policy, transport=transport, clients=num_clients)
    answers: list[Answer] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client(first: int) -> None:
        with httpx.Client(base_url=rig.url, timeout=120) as http:
            for k in itertools.count(first):
                last = stop.is_set()
                prompt = PROMPTS[k % len(PROMPTS)]
                with lock:
                    figures.sent += 1
                body, error = _generate(http, prompt, max_new_tokens)
                with lock:
                    if body is None:
                        figures.failed += 1
                        figures.errors.append(error)
                        continue
                    meta = body["meta_info"]
                    answer = Answer(prompt, tuple(body["output_ids"]),
                                    tuple(lp for lp, _, _ in meta["output_token_logprobs"]),
                                    _weightsync_versions(meta), meta["finish_reason"]["type"])
                    answers.append(answer)
                    if answer.finish == "abort":
                        figures.aborted += 1
                    elif answer.finish == "length" and len(answer.output_ids) == max_new_tokens:
                        figures.completed += 1
                    else:
                        figures.failed += 1
                        figures.errors.append(f"unexpected finish {meta['finish_reason']}")
                if last:
                    return

    served: dict[int, Weights] = {}
    with rig.sync(transport, pause=policy, timeout_s=PUSH_TIMEOUT_S) as sync:
        version = rig.push(sync)
        served[version] = rig.weights
        threads = [threading.Thread(target=client, args=(i,), name=f"weightsync-load-{i}", daemon=True)
                   for i in range(num_clients)]
        for t in threads:
            t.start()
        try:
            for _ in range(num_pushes):
                figures.held += _hold_running(rig)
                try:
                    version = rig.push(sync)
                finally:
                    rig.continue_generation()  # the push resumed, except under "none"
                served[version] = rig.weights
                figures.pushes += 1
        finally:
            stop.set()
            for t in threads:
                t.join(120)
    verifier = AnswerVerifier(rig.model_dir, served, policy)
    for answer in answers:
        if len(answer.versions) > 1 and answer.finish == "length":
            figures.spanning += 1
        problem = verifier.problem(answer)
        if problem is not None:
            figures.torn += 1
            figures.errors.append(problem)
    return figures


def _weightsync_versions(meta: dict[str, Any]) -> tuple[int, ...]:
    """The weightsync versions an answer ran on, in order (its SGLang spans also split
    where only the label changed)."""
    return tuple(dict.fromkeys(span["weightsync_version"] for span in meta["weight_versions"]))


def _generate(http: httpx.Client, prompt: Sequence[int], max_new_tokens: int) -> tuple[dict[str, Any] | None, str]:
    """One greedy request with logprobs: (answer, "") or (None, what went wrong)."""
    try:
        response = http.post("/generate", json={
            "input_ids": list(prompt), "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}})
    except httpx.HTTPError as e:
        return None, f"{type(e).__name__}: {e}"
    if response.status_code != 200:
        return None, f"HTTP {response.status_code}: {response.text[:200]}"
    return dict(response.json()), ""


def _hold_running(rig: Rig, timeout_s: float = 60.0) -> int:
    """Pause generation in place with requests mid-decode; returns how many it holds.

    The in_place pause's count is the engine's own, taken between two steps: requests
    running then have a token and are unfinished. A pause that held none (the requests
    seen running had finished) is undone and tried again."""
    deadline = time.monotonic() + timeout_s
    while True:
        if rig.info()["running_requests"]:
            held = rig.pause_generation("in_place")
            if held:
                return held
            rig.continue_generation()
        if time.monotonic() > deadline:
            raise RuntimeError(f"no request was running within {timeout_s:.0f}s of load")
        time.sleep(0.005)  # polling the engine's own count; it decides


class AnswerVerifier:
    """Replays an answer step by step with Hugging Face transformers to prove which whole
    weight versions computed it.

    Each generated token must be the greedy token of, and carry the logprob of, the
    version in force at its step; versions change only forward, through the versions the
    answer reports. A retracted request recomputes its KV cache with the new version;
    otherwise (none, in_place) the cache computed with older versions is kept. An answer
    that no such replay reproduces was computed with a torn weight set (or is wrong).
    """

    def __init__(self, model_dir: Path, versions: dict[int, Weights], policy: str) -> None:
        self.model_dir = model_dir
        self.weights = versions
        self.policy = policy
        self._base: Any = None
        self._models: dict[int, Any] = {}
        self._seen: dict[Answer, str | None] = {}

    def _model(self, version: int) -> Any:
        if version not in self._models:
            if self._base is None:
                from transformers import AutoModelForCausalLM

                self._base = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
            model = copy.deepcopy(self._base)
            model.load_state_dict(self.weights[version])
            self._models[version] = model
        return self._models[version]

    def problem(self, answer: Answer) -> str | None:
        if answer not in self._seen:
            self._seen[answer] = self._check(answer)
        return self._seen[answer]

    def _check(self, answer: Answer) -> str | None:
        if not answer.output_ids:
            return None  # aborted before its first step: nothing was computed
        unknown = [v for v in answer.versions if v not in self.weights]
        if unknown or not answer.versions:
            return f"{answer.prompt}: versions {answer.versions} were never pushed"
        if self.policy == "abort" and answer.finish == "length" and len(answer.versions) != 1:
            return f"{answer.prompt}: completed under 'abort' on versions {answer.versions}"
        return self._replay(answer)

    @torch.no_grad()
    def _replay(self, answer: Answer) -> str | None:
        from transformers import DynamicCache

        if len(answer.versions) == 1:  # one version: one forward pass over the whole answer
            whole = torch.tensor([list(answer.prompt) + list(answer.output_ids[:-1])])
            logits = self._model(answer.versions[0])(input_ids=whole).logits[0, len(answer.prompt) - 1:]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            for i, (token, logprob) in enumerate(zip(answer.output_ids, answer.logprobs, strict=True)):
                if int(logprobs[i].argmax()) != token or abs(float(logprobs[i, token]) - logprob) > LOGPROB_TOLERANCE:
                    return (f"{answer.prompt}: token {i} ({token}, logprob {logprob:.5f}) is not what "
                            f"v{answer.versions[0]} computes")
            return None
        # Which step ran on which version is not reported: search the switch points. A token
        # may match two neighbouring versions when they barely differ, so the first match is
        # not always the right one (a greedy replay failed 1 answer in ~4 tests under load).
        found = self._search(answer, 0, 0, DynamicCache(), 0)
        if found is None:
            return None
        token_index = found
        token, logprob = answer.output_ids[token_index], answer.logprobs[token_index]
        return (f"{answer.prompt}: token {token_index} ({token}, logprob {logprob:.5f}) matches none of "
                f"versions {answer.versions} in order (no forward-only switch points ending on the last version "
                "reproduce the answer past it)")

    def _search(self, answer: Answer, i: int, j: int, cache: Any, cached: int) -> int | None:
        """Replay tokens i.. with versions[j] in force at token i, switching only forward, and
        ending on the last reported version. None: some switch points reproduce every token;
        else the furthest token no replay got past."""
        from transformers import DynamicCache

        if i == len(answer.output_ids):
            return None if j == len(answer.versions) - 1 else i - 1
        ids = list(answer.prompt) + list(answer.output_ids[:i])
        furthest = i
        for k in range(j, len(answer.versions)):
            if k != j and self.policy == "retract":  # retracted: the KV cache is recomputed with the new weights
                start, past = DynamicCache(), 0
            else:
                start, past = copy.deepcopy(cache), cached
            logits = self._model(answer.versions[k])(input_ids=torch.tensor([ids[past:]]), past_key_values=start,
                                                     use_cache=True).logits[0, -1]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            token, logprob = answer.output_ids[i], answer.logprobs[i]
            if int(logprobs.argmax()) != token or abs(float(logprobs[token]) - logprob) > LOGPROB_TOLERANCE:
                continue
            failed_at = self._search(answer, i + 1, k, start, len(ids))
            if failed_at is None:
                return None
            furthest = max(furthest, failed_at)
        return furthest
