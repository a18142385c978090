"""Sampling parameters and next-token selection."""

from __future__ import annotations

import pytest
import torch

from weightsync.server.sampling import (
    SamplingParams,
    filter_top_k_top_p,
    make_generator,
    next_token,
)


def test_defaults_match_sglang() -> None:
    params = SamplingParams.from_json({})
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.top_k == -1
    assert params.max_new_tokens == 128 and not params.greedy


@pytest.mark.parametrize(("raw", "field"), [
    ({"temperature": -1}, "temperature"), ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"max_new_tokens": -1}, "max_new_tokens"), ({"max_new_tokens": 1.5}, "max_new_tokens"),
    ({"stop": [""]}, "stop"), ({"stop_token_ids": [1, "x"]}, "stop_token_ids"), ({"seed": "1"}, "seed"),
])
def test_bad_params_name_the_field(raw: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_json(raw)


def test_greedy_picks_argmax_with_its_logprob() -> None:
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    token, logprob = next_token(logits, SamplingParams(temperature=0), None)
    assert token == 1
    assert logprob == pytest.approx(float(torch.log_softmax(logits, -1)[1]))


def test_top_k_and_top_p_keep_the_right_tokens() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert torch.count_nonzero(filter_top_k_top_p(probs, 2, 1.0)) == 2
    kept = filter_top_k_top_p(probs, -1, 0.7)  # 0.5 < 0.7, 0.8 >= 0.7: two tokens
    assert torch.count_nonzero(kept) == 2 and float(kept.sum()) == pytest.approx(1.0)
    assert torch.count_nonzero(filter_top_k_top_p(probs, -1, 0.01)) == 1  # the top token always stays


def test_seeded_sampling_is_reproducible() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.9, top_k=20, seed=7)

    def draw() -> list[int]:
        gen = make_generator(params)
        return [next_token(logits, params, gen)[0] for _ in range(20)]

    assert draw() == draw()
    assert make_generator(SamplingParams(temperature=0)) is None
