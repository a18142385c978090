"""Generation on a real `weightsync serve`: parity with Hugging Face transformers,
the SGLang answer shape, batching, stops, sampling, info routes."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from weightsync.integrity import digest

# fixtures server, client, tiny_model, model_root, kit: tests/support/server_fixtures.py

PROMPTS = [[5, 17, 42, 99, 3], [7, 8, 9], [100, 200, 300, 400, 500, 11, 12], [42]]


@pytest.fixture(scope="module")
def hf_model(tiny_model: Path, kit: SimpleNamespace) -> Any:
    return kit.load_model(tiny_model)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_and_logprobs_equal_transformers(client: Any, hf_model: Any, kit: SimpleNamespace,
                                                       prompt: list[int]) -> None:
    want_tokens, want_logprobs = kit.reference_greedy(hf_model, prompt, 12)
    got = client.generate(prompt, sampling_params={"max_new_tokens": 12, "ignore_eos": True}, return_logprob=True)
    assert got["output_ids"] == want_tokens
    logprobs = got["meta_info"]["output_token_logprobs"]
    assert [tok for _, tok, _ in logprobs] == want_tokens
    assert max(abs(lp - want) for (lp, _, _), want in zip(logprobs, want_logprobs, strict=True)) < 1e-4


def test_answer_has_sglang_shape_and_weight_version(client: Any) -> None:
    got = client.generate([5, 17, 42], sampling_params={"max_new_tokens": 4, "ignore_eos": True}, rid="my-rid")
    meta = got["meta_info"]
    assert set(got) == {"text", "output_ids", "meta_info"}
    assert meta["id"] == "my-rid"
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 4
    assert meta["weight_version"] == str(client.version())
    assert meta["weight_versions"] == [{"version": str(client.version()), "start": 0, "end": 4,
                                        "weightsync_version": client.version()}]
    assert meta["lora_path"] is None
    assert "output_token_logprobs" not in meta


def test_batch_of_prompts_answers_a_list_in_order(client: Any, hf_model: Any, kit: SimpleNamespace) -> None:
    # Two prompts of equal length run as one batched forward pass.
    prompts = [[5, 17, 42, 99, 3], [9, 8, 7, 6, 5], [1, 2, 3]]
    got = client.ok("/generate", {"input_ids": prompts, "return_logprob": True,
                                  "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}})
    assert isinstance(got, list) and len(got) == 3
    for prompt, answer in zip(prompts, got, strict=True):
        want_tokens, want_logprobs = kit.reference_greedy(hf_model, prompt, 6)
        assert answer["output_ids"] == want_tokens
        got_logprobs = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got_logprobs, want_logprobs, strict=True)) < 1e-4


def test_text_input_is_tokenized_and_decoded(client: Any, hf_model: Any, kit: SimpleNamespace,
                                             tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompt = "the quick brown fox"
    ids = tokenizer.encode(prompt)
    want_tokens, _ = kit.reference_greedy(hf_model, ids, 5)
    got = client.ok("/generate", {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 5,
                                                                       "ignore_eos": True}})
    assert got["output_ids"] == want_tokens
    assert got["text"] == tokenizer.decode(want_tokens, skip_special_tokens=True)
    assert got["meta_info"]["prompt_tokens"] == len(ids)


def test_input_token_logprobs_equal_transformers(client: Any, hf_model: Any) -> None:
    prompt = [5, 17, 42, 99, 3, 8]
    got = client.generate(prompt, sampling_params={"max_new_tokens": 1}, return_logprob=True, logprob_start_len=0)
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    want = [None] + [float(torch.log_softmax(logits[i - 1], -1)[prompt[i]]) for i in range(1, len(prompt))]
    entries = got["meta_info"]["input_token_logprobs"]
    assert [tok for _, tok, _ in entries] == prompt
    assert entries[0][0] is None
    assert max(abs(e[0] - w) for e, w in zip(entries[1:], want[1:], strict=True)) < 1e-4


def test_stop_token_ids_and_stop_strings(client: Any, hf_model: Any, kit: SimpleNamespace, tiny_model: Path) -> None:
    prompt = [5, 17, 42, 99, 3]
    want_tokens, _ = kit.reference_greedy(hf_model, prompt, 10)
    stop_at = want_tokens[3]
    got = client.generate(
        prompt, sampling_params={"max_new_tokens": 10, "stop_token_ids": [stop_at], "ignore_eos": True}
    )
    first = want_tokens.index(stop_at)
    assert got["output_ids"] == want_tokens[: first + 1]
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    full_text = str(tokenizer.decode(want_tokens, skip_special_tokens=True))
    stop = next((full_text[i:i + 2] for i in range(2, len(full_text) - 2) if full_text[i:i + 2].strip()), None)
    assert stop is not None
    got = client.generate(prompt, sampling_params={"max_new_tokens": 10, "stop": [stop], "ignore_eos": True})
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert got["text"] == full_text[: full_text.index(stop)]


def test_seeded_sampling_is_reproducible_and_valid(client: Any) -> None:
    params = {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "max_new_tokens": 8, "seed": 1234, "ignore_eos": True}
    first = client.generate([5, 17, 42], sampling_params=params, return_logprob=True)
    second = client.generate([5, 17, 42], sampling_params=params, return_logprob=True)
    assert first["output_ids"] == second["output_ids"]
    other = client.generate([5, 17, 42], sampling_params={**params, "seed": 99})
    assert other["meta_info"]["completion_tokens"] == 8
    assert all(lp <= 0 and math.isfinite(lp) for lp, _, _ in first["meta_info"]["output_token_logprobs"])


def test_max_new_tokens_zero_finishes_immediately(client: Any) -> None:
    got = client.generate([5, 6], sampling_params={"max_new_tokens": 0})
    assert got["output_ids"] == [] and got["meta_info"]["finish_reason"]["type"] == "length"


def test_info_routes(client: Any, tiny_model: Path) -> None:
    for route in ("/model_info", "/get_model_info"):
        info = client.http.get(route).json()
        assert info["is_generation"] is True
        assert info["model_path"] == str(tiny_model)
        assert info["weight_version"] == "0"
    assert client.http.get("/get_weight_version").json() == {"weight_version": "0"}
    assert client.http.get("/health").status_code == 200
    assert client.http.get("/health_generate").status_code == 200
    assert client.ok("/flush_cache")["success"] is True
    ws_info = client.info()
    assert ws_info["weightsync"] == 1 and ws_info["dirty"] is False
    assert ws_info["params"]["model.norm.weight"] == {"dtype": "float32", "shape": [128]}


def test_get_weights_by_name_matches_the_model(client: Any, hf_model: Any) -> None:
    params = dict(hf_model.named_parameters())
    for name, truncate in (("model.norm.weight", 5), ("model.layers.0.mlp.up_proj.weight", 2)):
        response = client.post("/get_weights_by_name", {"name": name, "truncate_size": truncate})
        assert response.status_code == 200
        want = params[name].detach()[:truncate]
        assert torch.equal(torch.tensor(response.json()), want)
        assert response.headers["x-weightsync-digest"] == digest(params[name].detach())
    assert client.post("/get_weights_by_name", {"name": "no.such.weight"}).status_code == 400


def test_digests_route_matches_local_digests(client: Any, hf_model: Any) -> None:
    want = {name: digest(p.detach()) for name, p in hf_model.named_parameters()}
    assert client.digests() == want
    some = client.ok("/weightsync/digests", {"names": ["model.norm.weight"]})
    assert some["digests"] == {"model.norm.weight": want["model.norm.weight"]}
