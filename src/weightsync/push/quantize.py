"""The trainer's weights quantized once, in the stream, for an engine that serves them quantized
(`formats.quantized.Quantization`): a source whose quantized weights come as the engine's dtype,
each followed by its scale, computed tensor by tensor as the packer asks for them (one weight and
its scale in hand beyond the bucket). Digests then cover the quantized bytes and each scale as a
tensor of its own. Single trainer rank: the coordinator refuses a sharded trainer (its followers
are not told the scales).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from weightsync.bucketing import TensorParts
from weightsync.errors import CastError
from weightsync.formats.quantized import Quantization
from weightsync.manifest import TensorMeta
from weightsync.sources import WeightSource


class QuantizedSource:
    """`source` with the weights `quantization` names replaced by their quantized form and scale.
    A weight the engine holds quantized but the source does not hold is left to the engine's check."""

    def __init__(self, source: WeightSource, quantization: Quantization) -> None:
        self.mode = source.mode
        self.quantization = quantization
        self._source = source
        self._weight_of = {scale: weight for weight, scale in quantization.scales.items()}
        """Scale name -> its weight's name."""

    def metas(self) -> Sequence[TensorMeta]:
        fmt = self.quantization.format
        metas: list[TensorMeta] = []
        for m in self._source.metas():
            scale = self.quantization.scales.get(m.hf_name)
            if scale is None:
                metas.append(m)
                continue
            if len(m.shape) != 2:
                raise CastError(f"{m.hf_name} is {list(m.shape)}; the engine holds it quantized as a 2-D weight")
            metas.append(TensorMeta(hf_name=m.hf_name, dtype=fmt.weight_dtype, shape=m.shape))
            metas.append(TensorMeta(hf_name=scale, dtype=fmt.scale_dtype, shape=fmt.scale_shape(m.shape)))
        return metas

    def tensors(self, hf_names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor | TensorParts]]:
        """Yield the named tensors in exactly the order given; a weight is read from the source and
        quantized when it or its scale is first asked for, the other kept until it is asked for."""
        names = list(hf_names) if hf_names is not None else [m.hf_name for m in self.metas()]
        read_order = list(dict.fromkeys(self._weight_of.get(n, n) for n in names))
        read = iter(self._source.tensors(read_order))
        pending: dict[str, torch.Tensor] = {}
        for name in names:
            if name in pending:
                yield name, pending.pop(name)
                continue
            source_name, tensor = next(read)
            expected = self._weight_of.get(name, name)
            if source_name != expected:
                raise ValueError(f"tensor stream out of order: got {source_name!r}, expected {expected!r}")
            scale_name = self.quantization.scales.get(source_name)
            if scale_name is None:
                yield name, tensor
                continue
            if isinstance(tensor, TensorParts):
                raise CastError(f"{source_name} comes in parts (stacked experts); weightsync quantizes whole weights: "
                                "hold the experts unfused, or push to an engine that serves them unquantized")
            q, scale = self.quantization.format.quantize(tensor, hf_name=source_name)
            del tensor
            if name == source_name:
                pending[scale_name] = scale
                yield name, q
            else:
                pending[source_name] = q
                yield name, scale
        if pending:
            raise ValueError(f"asked for {sorted(pending)[:4]} without the tensor quantized with it")


def quantized_source(source: WeightSource, quantization: Quantization | None) -> WeightSource:
    """`source`, quantized in the stream where the engines serve `quantization` (None: as it is)."""
    return source if quantization is None else QuantizedSource(source, quantization)


__all__ = ["QuantizedSource", "quantized_source"]
