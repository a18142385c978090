"""Configuration of the embedded engine (`weightsync serve`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Everything `weightsync serve` is started with."""

    model_dir: Path
    """Hugging Face model directory (config, safetensors weights, tokenizer)."""
    host: str = "127.0.0.1"
    """Interface to bind."""
    port: int = 0
    """TCP port; 0 picks a free one (printed on the listening line)."""
    admin_api_key: str | None = None
    """When set, mutating routes need `Authorization: Bearer <key>`."""
    enable_lora: bool = False
    """Accept LoRA adapters and route requests by `lora_path`."""
    max_loaded_loras: int = 4
    """Adapters kept loaded; least recently used ones beyond this are evicted."""
    disk_root: Path | None = None
    """Disk updates and adapter directories must resolve under this root
    (default: the model directory's parent)."""
    weight_version: str = "0"
    """The label the engine starts with (SGLang's `--weight-version`); a decimal
    integer also sets weightsync's starting version, any other label starts at 0."""
    session_timeout_s: float = 60.0
    """How long an update session of a trainer that sent no timeout_s (an SGLang-shaped
    session, or a manifest without one) may stay idle before another begin takes it;
    weightsync trainers send their push timeout, which rules their own sessions."""
    staging_bytes_limit: int | None = None
    """Bytes a staged update may take beyond what the engine holds at begin, where the host's
    MemAvailable overstates what this process may use (a cgroup's limit); None: MemAvailable
    less `receive.staging_memory.STAGING_MARGIN_BYTES` only. A staged push needing more is
    refused at begin (HTTP 413)."""
    max_running: int = 16
    """Requests stepped together; more wait in the queue."""
    max_json_bytes: int = 64 << 20
    """Largest JSON request body."""
    group_timeout_s: float = 120.0
    """Timeout for joining a weight-update group and for each broadcast."""
    unload_timeout_s: float = 300.0
    """How long `/unload_lora_adapter` waits for requests still using the adapter."""
    num_threads: int | None = None
    """torch intra-op threads; None keeps torch's default."""
    weightsync_routes: bool = True
    """False: serve only SGLang's own API, as a stock SGLang server does (every
    `/weightsync/*` route answers 404), to test clients against SGLang's surface."""

    @property
    def resolved_disk_root(self) -> Path:
        return Path(self.disk_root) if self.disk_root is not None else Path(self.model_dir).resolve().parent
