"""A stock SGLang serving a quantized checkpoint (`--quantization`): the client reads what it
holds quantized from the checkpoint (`SGLangEngine(quantized_checkpoint=...)`), and a push then
sends the names SGLang's loader takes: each weight in its quantized dtype, its scale beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_engine_clients import Recorder, server  # noqa: F401  (the fixture: an HTTP server answering 404)

from weightsync.engines.sglang import SGLangEngine
from weightsync.manifest import TensorMeta
from weightsync.push.planning import cast_dtype
from weightsync.push.quantize import QuantizedSource

Q = "model.layers.0.self_attn.q_proj"
CONFIGS = {
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "int8": {"quant_method": "compressed-tensors", "ignore": ["lm_head"],
             "config_groups": {"g": {"targets": ["Linear"], "weights": {
                 "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}}}},
}


class _Float:
    """The trainer's float tensors of the checkpoint."""

    mode = "full"

    def __init__(self) -> None:
        self.state = {f"{Q}.weight": torch.randn(256, 64), "lm_head.weight": torch.randn(9, 64)}

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(hf_name=n, dtype=t.dtype, shape=tuple(t.shape)) for n, t in self.state.items()]

    def tensors(self, hf_names: list[str] | None = None):  # type: ignore[no-untyped-def]
        for name in hf_names if hf_names is not None else list(self.state):
            yield name, self.state[name]


@pytest.mark.parametrize(("kind", "scale", "weight_dtype", "scale_shape"), [
    ("fp8", f"{Q}.weight_scale_inv", torch.float8_e4m3fn, (2, 1)),
    ("int8", f"{Q}.weight_scale", torch.int8, (256, 1)),
])
def test_a_stock_sglang_gets_quantized_weights_under_its_loaders_names(
        server: Recorder, tmp_path: Path, kind: str, scale: str, weight_dtype: torch.dtype,  # noqa: F811
        scale_shape: tuple[int, ...]) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "quantization_config": CONFIGS[kind]}))
    save_file({f"{Q}.weight": torch.zeros(256, 64, dtype=weight_dtype),
               scale: torch.ones(scale_shape), "lm_head.weight": torch.zeros(9, 64)}, tmp_path / "model.safetensors")
    engine = SGLangEngine(server.url, label="stock", quantized_checkpoint=tmp_path)
    try:
        caps = engine.capabilities(10.0)
    finally:
        engine.close()
    assert caps.quantization is not None and caps.quantization.scales == {f"{Q}.weight": scale}
    source = QuantizedSource(_Float(), caps.quantization)
    cast = cast_dtype(None, {"stock": caps}, cast=True, quantization=caps.quantization)
    sent = {m.hf_name: (cast.of(m.hf_name, m.dtype), m.shape) for m in source.metas()}
    assert sent == {f"{Q}.weight": (weight_dtype, (256, 64)), scale: (torch.float32, scale_shape),
                    "lm_head.weight": (torch.float32, (9, 64))}
