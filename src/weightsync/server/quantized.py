"""A quantized checkpoint (`formats.quantized`: int8 per channel, fp8 in blocks) served dequantized
by the embedded engine: loading it into a floating model (`load_quantized`), what a push into it
must send (the checkpoint's own headers: each quantized weight with its float32 scale), the checks
at begin, and the dequantizing at commit (`ServedQuantization.dequantize`). The arithmetic and
its cost: docs/QUANTIZED.md ("weightsync serve").
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from weightsync.engines.quantized_checkpoint import read_quantization
from weightsync.errors import ConflictError, IntegrityError, format_names
from weightsync.formats.quantized import Quantization, check_quantized
from weightsync.formats.version_dir import read_checkpoint_metas
from weightsync.manifest import Manifest, TensorMeta

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ServedQuantization:
    """What the engine's checkpoint holds quantized and how a push into it is taken: the quantized
    weights and their scales as the checkpoint's headers say, dequantized at commit into the
    served (floating) parameters."""

    quantization: Quantization
    """The checkpoint's format and weight -> scale names (`EngineCapabilities.quantization`)."""
    checkpoint: Mapping[str, TensorMeta]
    """Checkpoint name -> dtype and shape of each quantized weight and scale, from its headers."""

    @property
    def weight_of(self) -> dict[str, str]:
        """Scale name -> its weight's name."""
        return {scale: weight for weight, scale in self.quantization.scales.items()}

    @property
    def fused_groups(self) -> tuple[tuple[str, ...], ...]:
        """Each quantized weight with its scale: a delta sends both whenever either changed, so a
        weight is always dequantized from the bytes and scale of one push."""
        return tuple((w, s) for w, s in self.quantization.scales.items())

    def expected(self, served: Mapping[str, TensorMeta]) -> dict[str, TensorMeta]:
        """What a push sends (`receive.update_session.Applier.expected`): `served` (the served
        parameters), with each quantized weight and its scale as the checkpoint holds them."""
        out = dict(served)
        for weight, scale in self.quantization.scales.items():
            out[weight] = self.checkpoint[weight]
            out[scale] = self.checkpoint[scale]
        return out

    def check(self, manifest: Manifest, served: Mapping[str, TensorMeta], *, who: str) -> None:
        """Refuse at begin what cannot dequantize right: a sparse update or a streamed commit
        (409: a trainer sends the whole model, staged), a quantized weight in another dtype, a
        weight without its scale, a scale of the wrong dtype or shape (ManifestMismatchError,
        naming them; `formats.quantized.check_quantized`)."""
        kind = self.quantization.format.kind
        if manifest.mode == "sparse":
            raise ConflictError(f"{who} serves a quantized checkpoint ({kind}), dequantized at commit: a sparse "
                                "update's elements would land without their scales; send a full update")
        if manifest.commit == "streamed":
            raise ConflictError(f"{who} serves a quantized checkpoint ({kind}), dequantized at commit from each "
                                "weight and its scale together: it takes no streamed commit; send commit='staged'")
        sent = [TensorMeta(hf_name=e.hf_name, dtype=e.dtype, shape=e.shape) for e in manifest.entries()]
        check_quantized(sent, self.expected(served), self.quantization.format, who=who)

    def dequantized_bytes(self, manifest: Manifest, served: Mapping[str, TensorMeta]) -> int:
        """Bytes a commit of `manifest` allocates for the quantized weights it sends, dequantized
        into the served dtype (beyond its staged buckets; one weight's float32 temporary aside)."""
        scales = self.quantization.scales
        return sum(served[e.hf_name].nbytes for e in manifest.entries() if e.hf_name in scales)

    def dequantize(self, tensors: Mapping[str, torch.Tensor], served: Mapping[str, TensorMeta], *,
                   refused: str) -> dict[str, torch.Tensor]:
        """`tensors` (a checked update: quantized weights with their scales, other tensors in the
        served dtype) as the served parameters take them: each quantized weight dequantized
        (`QuantFormat.dequantize`: float32 value times float32 scale) and cast to its parameter's
        dtype, the scales dropped, the rest as they are. Raises IntegrityError naming every weight
        whose dequantized values are not all finite (a NaN or infinite scale, an fp8 NaN), after
        `refused` (what is refused): nothing is served of it."""
        fmt, scales, weight_of = self.quantization.format, self.quantization.scales, self.weight_of
        out: dict[str, torch.Tensor] = {}
        bad: list[str] = []
        for hf_name, tensor in tensors.items():
            if hf_name in weight_of:
                continue
            scale = scales.get(hf_name)
            if scale is None:
                out[hf_name] = tensor
                continue
            value = fmt.dequantize(tensor, tensors[scale]).to(served[hf_name].dtype)
            if not bool(torch.isfinite(value).all()):
                bad.append(hf_name)
            out[hf_name] = value
        if bad:
            raise IntegrityError(f"{refused}: {format_names(bad)} dequantize to NaN or infinity (their scales or "
                                 "values as sent); fix the trainer's weights or quantizer")
        return out


def read_served_quantization(model_dir: str | Path) -> ServedQuantization | None:
    """The quantization the checkpoint in `model_dir` declares (its `quantization_config` and
    safetensors headers), or None for a floating checkpoint."""
    quantization = read_quantization(model_dir)
    if quantization is None:
        return None
    names = {*quantization.scales, *quantization.scales.values()}
    checkpoint = {m.hf_name: m for m in read_checkpoint_metas(Path(model_dir)) if m.hf_name in names}
    return ServedQuantization(quantization=quantization, checkpoint=checkpoint)


def load_quantized(model_dir: str | Path, served: ServedQuantization) -> nn.Module:
    """The causal LM of the quantized checkpoint in `model_dir`, built from its config without
    the `quantization_config` in the config's dtype, each quantized weight dequantized into it
    as a commit does (`ServedQuantization.dequantize`). Raises ValueError naming the tensors the
    model and the checkpoint do not share (a model transformers converts on load: fused experts)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    model_dir = Path(model_dir)
    config: Any = AutoConfig.from_pretrained(model_dir)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else torch.float32
    model: Any = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(path))
    metas = {name: TensorMeta.of(name, p) for name, p in model.state_dict().items()}
    scales = served.quantization.scales
    missing = [n for n in scales if n not in metas]
    if missing:
        raise ValueError(f"{model_dir}: the model built from its config has no {format_names(missing)}; weightsync "
                         "serve dequantizes dense models' linear weights only")
    state = served.dequantize(state, metas, refused=f"{model_dir} is not served")
    result = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ()) if getattr(config, "tie_word_embeddings", False) \
        else set()
    unloaded = [n for n in result.missing_keys if n not in tied]
    if unloaded or result.unexpected_keys:
        raise ValueError(f"{model_dir}: checkpoint and model differ: missing {format_names(unloaded)}, "
                         f"unexpected {format_names(result.unexpected_keys)}")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    if (model_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    log.info("%s: %d quantized weight(s) (%s) dequantized to %s", model_dir, len(scales),
             served.quantization.format.kind, str(dtype).removeprefix("torch."))
    loaded: nn.Module = model.eval()
    return loaded


__all__ = ["ServedQuantization", "load_quantized", "read_served_quantization"]
