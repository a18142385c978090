"""`ws.probe_logprobs` against an engine that declares quantized weights: the reference is the
trainer's weights as sent (`probe.as_sent`); a model that does not hold the engine's quantized
weights under the checkpoint's names is refused by name. The engine here is a stand-in that
answers the trainer's own greedy tokens and logprobs (the real engines: tests/integration/
test_server_quantized.py)."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

import weightsync as ws
from weightsync.engines.base import Completion
from weightsync.formats.quantized import INT8_CHANNEL, QuantFormat, Quantization
from weightsync.probe import as_sent, trainer_logprobs
from weightsync.tiny import make_tiny_model

FMT = QuantFormat(kind=INT8_CHANNEL, scale_suffix="weight_scale")


class AsSentEngine:
    """Answers `model` with `weights` substituted: what an engine holding the sent bytes computes."""

    def __init__(self, model: Any, weights: dict[str, torch.Tensor], quantization: Quantization) -> None:
        self.model, self.weights, self.quantization = model, weights, quantization

    def capabilities(self, timeout_s: float) -> Any:
        return SimpleNamespace(quantization=self.quantization)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 0.0,
                 lora_name: str | None = None, seed: int | None = None) -> list[Completion]:
        out = []
        for prompt in prompts:
            ids: list[int] = []
            for _ in range(max_new_tokens):  # greedy, one token at a time
                ids.append(int(trainer_logprobs(self.model, prompt, [*ids, 0], self.weights)[1][-1]))
            logprobs, _ = trainer_logprobs(self.model, prompt, ids, self.weights)
            out.append(Completion(output_ids=ids, logprobs=logprobs.tolist(), weight_version="1",
                                  finish_reason="length"))
        return out


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path_factory.mktemp("probe"))).eval()


def _quantization(model: Any) -> Quantization:
    names = [n for n, p in model.named_parameters() if p.dim() == 2 and ".layers." in n]
    return Quantization(format=FMT, scales={n: FMT.scale_name(n) for n in names})


def test_the_reference_is_the_weights_as_sent_and_the_trainer_gap_is_reported(model: Any) -> None:
    quantization = _quantization(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sent = as_sent(model, quantization)
    assert sent.keys() == quantization.scales.keys()
    for name, value in sent.items():
        assert torch.equal(value, FMT.dequantize(*FMT.quantize(before[name])))
    with torch.no_grad():
        result = ws.probe_logprobs(model, AsSentEngine(model, sent, quantization), [[5, 17, 42]], max_new_tokens=4)
    assert result.quantized == INT8_CHANNEL and result.max_gap == 0.0 and result.token_agreement == 1.0, result
    assert result.trainer_max_gap is not None and result.trainer_max_gap > 0.0, result  # what int8 costs, reported
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # the model itself is unchanged


def test_a_model_without_the_checkpoints_names_is_refused_by_name(model: Any) -> None:
    quantization = _quantization(model)
    renamed = Quantization(format=FMT, scales={f"base_model.{n}": s for n, s in quantization.scales.items()})
    with pytest.raises(ValueError, match=r"base_model\.model\.layers\.0\..*probe with the model whose parameter "
                                         r"names are the checkpoint's"):
        ws.probe_logprobs(model, AsSentEngine(model, {}, renamed), [[5, 17, 42]], max_new_tokens=2)
