"""Concurrent generate clients while weights change, under each pause mode.

abort ends the in-flight requests with finish_reason abort; retract and
in_place finish every request; requests sent while paused wait and run on the
new weights. None is lost, and every answer names the versions it used.
"""

from __future__ import annotations

import base64
import pickle
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

from serve_check import wait_until
from weightsync.integrity import digest

# fixtures server, client, tiny_model, model_root, kit: tests/support/server_fixtures.py

MAX_NEW_TOKENS = 160
# Distinct prompt lengths: requests never share a batch, so each is comparable with
# a batch-of-one reference bit for bit.
IN_FLIGHT = [[5, 17, 42], [9, 8, 7, 6], [100, 200, 300, 400, 500], [11, 12, 13, 14, 15, 16]]
LATE = [[21, 22], [31, 32, 33, 34, 35, 36, 37]]
MAX_ROUNDS = 5
"""Rounds of IN_FLIGHT requests sent until a pause catches them mid-decode (one, unless
all MAX_NEW_TOKENS steps run between a continue and the next pause)."""


def push_tensors(client: Any, weights: dict[str, torch.Tensor], version: int) -> None:
    payload = base64.b64encode(pickle.dumps(list(weights.items()))).decode()
    client.ok("/update_weights_from_tensor", {"serialized_named_tensors": [payload],
                                              "weight_version": str(version), "flush_cache": False})


def submit(pool: ThreadPoolExecutor, url: str, prompt: list[int]) -> Future[dict[str, Any]]:
    def call() -> dict[str, Any]:
        with httpx.Client(base_url=url, timeout=120.0) as http:
            response = http.post("/generate", json={
                "input_ids": prompt, "return_logprob": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True},
            })
            response.raise_for_status()
            return response.json()

    return pool.submit(call)


def versions_of(answer: dict[str, Any]) -> list[int]:
    """The weightsync versions of an answer's weight-version spans, in order."""
    return [span["weightsync_version"] for span in answer["meta_info"]["weight_versions"]]


def hold_mid_decode(client: Any, pool: ThreadPoolExecutor, prompts: list[list[int]]) -> list[Future[dict[str, Any]]]:
    """Requests for `prompts`, held mid-decode by an in_place pause. Sent while generation
    is paused, they are admitted together on continue and step in lockstep; the next
    in_place pause reports how many it froze while running: all of them (each has a
    token and is unfinished), none yet (paused before the first step: continue again),
    or none left (all finished in between, answered in full: send new ones)."""
    for _ in range(MAX_ROUNDS):
        client.ok("/pause_generation", {"mode": "in_place"})
        futures = [submit(pool, client.url, p) for p in prompts]
        wait_until(lambda: client.info()["waiting_requests"] == len(prompts), "requests to queue")
        while client.info()["waiting_requests"]:
            client.ok("/continue_generation")
            if client.ok("/pause_generation", {"mode": "in_place"})["num_paused_requests"] == len(prompts):
                return futures
        client.ok("/continue_generation")
        assert all(f.result()["meta_info"]["finish_reason"]["type"] == "length" for f in futures)
    raise AssertionError(f"in {MAX_ROUNDS} rounds no pause caught the requests mid-decode")


def split_point(output: list[int], old_tokens: list[int]) -> int:
    """Tokens at the start of `output` that the old weights produced (at least 1: the prefill)."""
    k = 0
    while k < len(output) and output[k] == old_tokens[k]:
        k += 1
    return k


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_update_under_pause(client: Any, kit: SimpleNamespace, tiny_model: Path, mode: str) -> None:
    seed = {"abort": 30, "retract": 40, "in_place": 50}[mode]
    old_weights, new_weights = kit.perturbed(tiny_model, seed=seed), kit.perturbed(tiny_model, seed=seed + 1)
    old = client.version() + 1
    push_tensors(client, old_weights, old)

    with ThreadPoolExecutor(len(IN_FLIGHT) + len(LATE)) as pool:
        in_flight = hold_mid_decode(client, pool, IN_FLIGHT)
        paused = client.ok("/pause_generation", {"mode": mode})
        assert paused["num_paused_requests"] == len(IN_FLIGHT)
        late = [submit(pool, client.url, p) for p in LATE]
        wait_until(lambda: client.info()["waiting_requests"] == len(LATE), "late requests to queue")
        if mode != "abort":
            assert client.post("/flush_cache").status_code == 400  # requests are still held
        push_tensors(client, new_weights, old + 1)
        assert client.info()["paused"] == mode
        client.ok("/continue_generation")
        results = [f.result() for f in in_flight]
        late_results = [f.result() for f in late]

    assert client.digests() == {n: digest(t) for n, t in new_weights.items()}
    for answer in late_results:  # waited while paused, ran entirely on the new weights
        assert answer["meta_info"]["finish_reason"]["type"] == "length"
        assert versions_of(answer) == [old + 1]
        assert answer["meta_info"]["weight_version"] == str(old + 1)
    if mode == "abort":
        for answer in results:
            assert answer["meta_info"]["finish_reason"]["type"] == "abort"
            assert versions_of(answer) == [old]
            assert 0 < answer["meta_info"]["completion_tokens"] < MAX_NEW_TOKENS
        return
    old_model, new_model = kit.load_model(tiny_model, old_weights), kit.load_model(tiny_model, new_weights)
    for prompt, answer in zip(IN_FLIGHT, results, strict=True):
        meta = answer["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": MAX_NEW_TOKENS}
        assert versions_of(answer) == [old, old + 1] and meta["weight_version"] == str(old + 1)
        # SGLang's spans: tokens [0, j) came from the old weights, [j, end) from the new.
        first, second = meta["weight_versions"]
        j = first["end"]
        assert (first["start"], second["start"], second["end"]) == (0, j, MAX_NEW_TOKENS)
        output = answer["output_ids"]
        old_tokens, _ = kit.reference_greedy(old_model, prompt, MAX_NEW_TOKENS)
        k = split_point(output, old_tokens)
        assert 0 < j <= k < MAX_NEW_TOKENS, "the request must span the update"
        if mode == "retract":
            # KV dropped at pause and recomputed with the new weights: from the split on,
            # the output is exactly the new model's continuation of prompt + old tokens.
            assert output[j:] == kit.reference_greedy(new_model, prompt + output[:j], MAX_NEW_TOKENS - j)[0], \
                f"retracted request did not continue from a recomputed KV (split at {j})"
        else:
            # KV kept from the old weights; only the new tokens use the new weights.
            assert output[j:] == continue_with_kept_cache(old_model, new_model, prompt + output[: j - 1],
                                                          output[j - 1], MAX_NEW_TOKENS - j), \
                f"in-place request did not keep its KV cache (split at {j})"


def continue_with_kept_cache(old_model: Any, new_model: Any, prefix: list[int], last: int, n: int) -> list[int]:
    """Greedy tokens of `new_model` fed `last` on top of `old_model`'s KV cache of `prefix`."""
    tokens = []
    with torch.no_grad():
        cache = old_model(torch.tensor([prefix]), use_cache=True).past_key_values
        token = last
        for _ in range(n):
            out = new_model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
    return tokens


@pytest.mark.parametrize("mode", ["abort", "retract"])
def test_push_pauses_inside_its_commit(client: Any, kit: SimpleNamespace, tiny_model: Path, mode: str) -> None:
    """A push to `weightsync serve` holds generation for the commit alone, in the commit
    request itself: begin, the bucket, commit (3 round trips, no pause or continue), and
    requests in flight see the pause mode exactly as with a separate pause."""
    import weightsync

    seed = {"abort": 60, "retract": 70}[mode]
    old_weights, new_weights = kit.perturbed(tiny_model, seed=seed), kit.perturbed(tiny_model, seed=seed + 1)
    old = client.version() + 1
    push_tensors(client, old_weights, old)
    trainer = kit.load_model(tiny_model, new_weights)
    engine = weightsync.SGLangEngine(client.url)
    with ThreadPoolExecutor(len(IN_FLIGHT)) as pool, \
            weightsync.WeightSync([engine], transport="shm", pause=mode) as sync:
        engine.capabilities(60.0)  # asked once per session: not a round trip of the push
        in_flight = hold_mid_decode(client, pool, IN_FLIGHT)
        before = engine.num_requests
        report = sync.push(trainer, version=old + 1)
        assert engine.num_requests - before == 3, "begin, one bucket, commit"
        assert client.info()["paused"] is None, "the commit resumed generation"
        results = [f.result() for f in in_flight]

    assert report.verified and client.digests() == {n: digest(t) for n, t in new_weights.items()}
    for answer in results:
        if mode == "abort":
            assert answer["meta_info"]["finish_reason"]["type"] == "abort"
            assert versions_of(answer) == [old]
        else:
            assert answer["meta_info"]["finish_reason"]["type"] == "length"
            assert versions_of(answer) == [old, old + 1]


def test_failed_commit_resumes_generation(client: Any, kit: SimpleNamespace, tiny_model: Path) -> None:
    """A commit that names a pause mode and fails (a bucket never arrived) still resumes."""
    manifest, _ = kit.make_update(kit.perturbed(tiny_model, seed=80), version=client.version() + 1)
    client.ok("/weightsync/begin", {"manifest": manifest.to_dict()})
    refused = client.post("/weightsync/commit", {"version": manifest.version, "pause": "retract"})
    assert refused.status_code == 400 and "never arrived" in refused.json()["message"]
    assert client.info()["paused"] is None
    client.ok("/weightsync/abort", {"version": manifest.version})


def test_a_pause_that_arrives_after_its_resume_is_not_applied(client: Any) -> None:
    """A trainer whose pause got no answer in time resumes the engine, and the pause may reach
    the engine (or a step boundary) only after that resume: named by weightsync's client, it
    is then not applied, so generation is not held until a resume that never comes. A pause
    of another id still pauses."""
    client.ok("/continue_generation", {"pause_id": "late-1"})
    assert client.ok("/pause_generation", {"mode": "retract", "pause_id": "late-1"})["num_paused_requests"] == 0
    assert client.info()["paused"] is None
    assert client.generate([5, 17, 42], sampling_params={"max_new_tokens": 2})["meta_info"]["finish_reason"][
        "type"] == "length"
    client.ok("/pause_generation", {"mode": "retract", "pause_id": "next-2"})
    try:
        assert client.info()["paused"] == "retract"
    finally:
        client.ok("/continue_generation", {"pause_id": "next-2"})
    assert client.info()["paused"] is None
