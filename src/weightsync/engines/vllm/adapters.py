"""The LoRA adapters a vLLM worker takes: checked against the model it serves, then written
as PEFT directories that the client registers with vLLM (`add_lora` /
`/v1/load_lora_adapter`). Engine rank 0 writes them, in a private temporary directory of
its process (the engine's ranks share a host). The design: docs/VLLM.md, "The worker"."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from weightsync.errors import EngineError, ManifestMismatchError, format_names
from weightsync.manifest import Manifest, TensorMeta

PEFT_PREFIX = "base_model.model."
LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
LORA_ROOT_PREFIX = "weightsync-vllm-lora-"
"""Adapter directories live in `<tmp>/weightsync-vllm-lora-<pid>-<random>/<lora_name>/`."""


def check_adapter(manifest: Manifest, lora_config: Any, expected: Mapping[str, TensorMeta], *, who: str) -> None:
    """Refuse, naming the offenders, an adapter this vLLM cannot serve: LoRA off
    (`lora_config` None), DoRA, biases, names that are not LoRA A/B of a linear layer of
    the model (`expected`: checkpoint name -> meta), shapes that do not fit it."""
    if lora_config is None:
        raise EngineError(who, f"adapter {manifest.lora_name!r}: this vLLM runs without LoRA; "
                          "start it with enable_lora=True (--enable-lora) and max_lora_rank")
    config = dict(manifest.lora_config or {})
    if config.get("use_dora"):
        raise EngineError(who, f"adapter {manifest.lora_name!r}: vLLM does not serve DoRA adapters")
    if config.get("bias", "none") != "none":
        raise EngineError(who, f"adapter {manifest.lora_name!r}: vLLM does not serve adapters with "
                          f"bias={config.get('bias')!r}; train with bias='none'")
    unexpected, mismatched = [], []
    for entry in manifest.entries():
        module = _lora_module(entry.hf_name)
        base = expected.get(f"{module}.weight") if module else None
        if module is None or base is None or len(base.shape) != 2 or len(entry.shape) != 2:
            unexpected.append(entry.hf_name)
            continue
        out_features, in_features = base.shape
        rank = entry.shape[0] if entry.hf_name.endswith(".lora_A.weight") else entry.shape[1]
        want = (rank, in_features) if entry.hf_name.endswith(".lora_A.weight") else (out_features, rank)
        if entry.shape != want or rank > lora_config.max_lora_rank:
            mismatched.append(f"{entry.hf_name}: {entry.shape} (base {module}.weight is {base.shape}, "
                              f"max_lora_rank {lora_config.max_lora_rank})")
    if unexpected or mismatched:
        parts = []
        if unexpected:
            parts.append(f"{len(unexpected)} name(s) that are not LoRA A/B of a linear layer of this model "
                         f"(PEFT names {PEFT_PREFIX}<module>.lora_A.weight / .lora_B.weight): "
                         f"{format_names(unexpected)}")
        if mismatched:
            parts.append(f"{len(mismatched)} shape mismatch(es): " + "; ".join(mismatched[:8]))
        raise ManifestMismatchError(f"adapter {manifest.lora_name!r} refused: " + " | ".join(parts),
                                    unexpected=unexpected, mismatched=[m.split(":", 1)[0] for m in mismatched])


class AdapterDirs:
    """The PEFT directories one worker wrote, by adapter name, and their retirement: a
    directory unloaded before the previous commit goes at the next adapter commit (one
    push of grace, so a request still running on an evicted adapter can reload it)."""

    def __init__(self) -> None:
        self.last: Path | None = None
        """Where the last adapter commit wrote its directory (None: not engine rank 0)."""
        self._dirs: dict[str, Path] = {}
        self._retired: list[Path] = []
        self._root: Path | None = None

    def write(self, manifest: Manifest, tensors: Mapping[str, torch.Tensor], *, rank: int) -> None:
        """Write the verified adapter of `manifest` as a PEFT directory (engine rank 0 only)."""
        assert manifest.lora_name is not None and manifest.lora_config is not None
        self._delete_retired()
        self.last = None
        if rank != 0:
            return
        from safetensors.torch import save_file

        root = self._root_dir()
        target = root / manifest.lora_name
        tmp = root / f".{manifest.lora_name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        named = {e.hf_name: tensors[e.hf_name].contiguous() for e in manifest.entries()}
        save_file(named, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(dict(manifest.lora_config), indent=2, sort_keys=True))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        self._dirs[manifest.lora_name] = target
        self.last = target

    def forget(self, lora_name: str) -> None:
        """vLLM unloaded `lora_name`: its directory goes at the next adapter commit but one."""
        path = self._dirs.pop(lora_name, None)
        if path is not None:
            self._retired.append(path)

    def _root_dir(self) -> Path:
        if self._root is None:
            _remove_stale_roots()
            self._root = Path(tempfile.mkdtemp(prefix=f"{LORA_ROOT_PREFIX}{os.getpid()}-"))
            atexit.register(shutil.rmtree, self._root, ignore_errors=True)
        return self._root

    def _delete_retired(self) -> None:
        keep = self._retired[-1:] if self._retired else []
        for path in self._retired[:-1]:
            shutil.rmtree(path, ignore_errors=True)
        self._retired = keep


def _remove_stale_roots() -> None:
    """Delete adapter directories of worker processes that are gone (vLLM kills its
    workers at shutdown, so their atexit cleanup may never run)."""
    for path in Path(tempfile.gettempdir()).glob(f"{LORA_ROOT_PREFIX}*-*"):
        pid_text = path.name[len(LORA_ROOT_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            pass  # alive, someone else's


def _lora_module(peft_name: str) -> str | None:
    """`base_model.model.<module>.lora_A.weight` -> `<module>` (None for anything else)."""
    if not peft_name.startswith(PEFT_PREFIX):
        return None
    for suffix in LORA_SUFFIXES:
        if peft_name.endswith(suffix):
            return peft_name[len(PEFT_PREFIX) : -len(suffix)]
    return None
