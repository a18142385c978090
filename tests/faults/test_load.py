"""Generation under load while pushes run back to back, per pause policy, against a
real `weightsync serve`: no request fails or is lost, aborts happen only under
"abort", and every answer is reproduced token by token (greedy token and logprob)
by whole pushed versions, so no answer was computed with a torn weight set.

The replay (`AnswerVerifier`) is itself tested here: it must reject answers
computed with a half-applied update.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from weightsync_tools import faults
from weightsync_tools.faults import Answer, AnswerVerifier, Rig, Weights

# fixtures rig, fault_model: tests/support/fault_fixtures.py; one_torch_thread: tests/support/server_fixtures.py
# (the replay runs transformers here while the engine generates)
pytestmark = pytest.mark.faults


@pytest.mark.parametrize("policy", faults.POLICIES)
def test_load_under_back_to_back_pushes(rig: Rig, policy: str, one_torch_thread: None) -> None:
    figures = faults.run_load(rig, policy, num_clients=3, num_pushes=4, max_new_tokens=24)
    print(f"\n{figures.summary()}")
    assert figures.pushes == 4
    assert figures.held >= 4, "every push began with requests held mid-decode"
    assert figures.failed == 0, figures.errors[:5]
    assert figures.lost == 0, "sent == completed + aborted"
    assert figures.torn == 0, figures.errors[:5]
    assert figures.completed >= 3, "each client's request sent after the last push completes"
    if policy == "abort":
        assert figures.aborted >= figures.held, "requests held at a push are aborted"
        assert figures.spanning == 0, "an answer that completes under 'abort' ran on one version"
    else:
        assert figures.aborted == 0, f"'{policy}' never drops a request"
        assert figures.spanning > 0, "requests held at a push span the update (two versions, each whole)"


# -- the replay is strict enough to catch a torn weight set -----------------------------------------


def _model(model_dir: Path, weights: Weights) -> Any:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(weights)
    return model


@torch.no_grad()
def _greedy(
    models: list[Any], prompt: tuple[int, ...], *, retract: bool = False
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Greedy decoding where step i runs `models[i]` on a KV cache kept across steps
    (dropped and recomputed whenever the model changes, with `retract`)."""
    ids, logprobs = list(prompt), []
    cache, cached = DynamicCache(), 0
    for i, model in enumerate(models):
        if retract and i and model is not models[i - 1]:
            cache, cached = DynamicCache(), 0
        out = model(input_ids=torch.tensor([ids[cached:]]), past_key_values=cache, use_cache=True)
        cached = len(ids)
        step = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        ids.append(int(step.argmax()))
        logprobs.append(float(step.max()))
    return tuple(ids[len(prompt):]), tuple(logprobs)


def test_the_replay_rejects_answers_from_a_torn_weight_set(fault_model: Path, one_torch_thread: None) -> None:
    base = faults.load_weights(fault_model)
    v1, v2 = faults.perturbed(base, seed=1), faults.perturbed(base, seed=2)
    torn = {n: (v1 if ".layers.0." in n else v2)[n] for n in v1}  # an update applied halfway
    m1, m2, m_torn = _model(fault_model, v1), _model(fault_model, v2), _model(fault_model, torn)
    prompt, steps = faults.PROMPTS[0], 12
    versions = {1: v1, 2: v2}

    def answer(models: list[Any], claimed: tuple[int, ...], *, retract: bool = False) -> Answer:
        output, logprobs = _greedy(models, prompt, retract=retract)
        return Answer(prompt, output, logprobs, claimed, "length")

    whole = answer([m1] * steps, (1,))
    spans_kept = answer([m1] * 5 + [m2] * (steps - 5), (1, 2))
    spans_retracted = answer([m1] * 5 + [m2] * (steps - 5), (1, 2), retract=True)
    assert AnswerVerifier(fault_model, versions, "none").problem(whole) is None
    assert AnswerVerifier(fault_model, versions, "in_place").problem(spans_kept) is None
    assert AnswerVerifier(fault_model, versions, "retract").problem(spans_retracted) is None

    for policy in faults.POLICIES:
        verifier = AnswerVerifier(fault_model, versions, policy)
        for claimed in ((1,), (2,), (1, 2)):
            assert verifier.problem(answer([m_torn] * steps, claimed)) is not None, (policy, claimed)
            assert verifier.problem(answer([m1] * 5 + [m_torn] * (steps - 5), claimed)) is not None
    # Right tokens, wrong story: a kept-cache span is not what a retract computes, a
    # span is not allowed to complete under abort, and versions never run backwards.
    assert AnswerVerifier(fault_model, versions, "retract").problem(spans_kept) is not None
    assert AnswerVerifier(fault_model, versions, "abort").problem(spans_retracted) is not None
    backwards = answer([m2] * 5 + [m1] * (steps - 5), (1, 2))
    assert AnswerVerifier(fault_model, versions, "in_place").problem(backwards) is not None
