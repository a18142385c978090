"""weightsync: verified weight synchronization from RL trainers to inference engines.

    import weightsync as ws
    sync = ws.WeightSync(engines=[ws.SGLangEngine("http://127.0.0.1:30000")], transport="http")
    report = sync.push(model, version=step)

Heavy optional dependencies (vllm, fastapi, uvicorn) are imported only by the
modules that need them.
"""

from weightsync.bucketing import pack, plan_buckets, unpack
from weightsync.engines.base import Engine, EngineCapabilities, PausePolicy
from weightsync.engines.sglang import SGLangEngine
from weightsync.engines.vllm.client import VLLMEngine
from weightsync.engines.vllm.transfer_client import VLLMTransferEngine
from weightsync.errors import (
    AdapterNotLoadedError,
    CastError,
    EngineError,
    IntegrityError,
    ManifestError,
    ManifestMismatchError,
    NamingError,
    SyncTimeoutError,
    WeightSyncError,
)
from weightsync.lora.export import export_lora_adapter
from weightsync.manifest import BucketMeta, Manifest, TensorEntry, TensorMeta
from weightsync.modes import named_weights
from weightsync.probe import ProbeResult, probe_logprobs
from weightsync.push.sync import SyncConfig, WeightSync
from weightsync.reports import Ack, StageSeconds, SyncReport
from weightsync.sources import WeightSource

__all__ = [
    "Ack",
    "AdapterNotLoadedError",
    "BucketMeta",
    "CastError",
    "Engine",
    "EngineCapabilities",
    "EngineError",
    "IntegrityError",
    "Manifest",
    "ManifestError",
    "ManifestMismatchError",
    "NamingError",
    "PausePolicy",
    "ProbeResult",
    "SGLangEngine",
    "StageSeconds",
    "SyncConfig",
    "SyncReport",
    "SyncTimeoutError",
    "TensorEntry",
    "TensorMeta",
    "VLLMEngine",
    "VLLMTransferEngine",
    "WeightSource",
    "WeightSync",
    "WeightSyncError",
    "export_lora_adapter",
    "named_weights",
    "pack",
    "plan_buckets",
    "probe_logprobs",
    "unpack",
]
