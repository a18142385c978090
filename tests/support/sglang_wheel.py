"""SGLang's own payload classes and route auth levels, read from the sglang wheel's files (no sglang install).

scripts/test.sh installs the wheel with `pip install --no-deps --target .peer/sglang`.
`import sglang` would run the package's `__init__`, which pulls CUDA-only and other heavy
dependencies; so the packages on the way are registered as empty packages pointing at the
wheel's folders, and:
- `sglang/srt/weight_sync/tensor_bucket.py` (FlattenedTensorBucket) is imported as it is
  (it needs only torch);
- `LocalSerializedTensor` (model_runner_components/weight_updater.py),
  `MultiprocessingSerializer` (utils/common.py), and the weight checker's checksum
  functions (`_hash_tensor`, `overall_checksum` in utils/weight_checker.py, `tensor_hash`
  in managers/mm_utils.py) live in modules whose imports need a GPU stack: their
  definitions are taken from those files' source, unchanged, and run in a module of the
  same name (so pickles name them as SGLang's own pickles do).

`loaded()` undoes the registration on exit: nothing named `sglang` stays in sys.modules.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import importlib
import io
import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest
import torch

SGLANG_VERSION = "0.5.23"
WHEEL_DIR = Path(__file__).resolve().parents[2] / ".peer" / "sglang"
UPDATER_MODULE = "sglang.srt.model_executor.model_runner_components.weight_updater"
COMMON_MODULE = "sglang.srt.utils.common"
CHECKER_MODULE = "sglang.srt.utils.weight_checker"
HASH_MODULE = "sglang.srt.managers.mm_utils"


def _package(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [str(WHEEL_DIR.joinpath(*name.split(".")))]
    return module


def _from_source(module_name: str, name: str, namespace: dict[str, Any]) -> Any:
    """Run the source of class or function `name` (decorators included) from the wheel's
    file of `module_name` in a module of that name, registered in sys.modules."""
    path = WHEEL_DIR.joinpath(*module_name.split(".")).with_suffix(".py")
    tree = ast.parse(path.read_text())
    nodes = [n for n in tree.body if isinstance(n, ast.ClassDef | ast.FunctionDef) and n.name == name]
    assert len(nodes) == 1, f"{path}: expected one definition of {name}, found {len(nodes)}"
    module = sys.modules.get(module_name) or types.ModuleType(module_name)
    module.__dict__.update(namespace)
    sys.modules[module_name] = module
    code = compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec")
    exec(code, module.__dict__)
    return module.__dict__[name]


@contextmanager
def loaded() -> Iterator[types.SimpleNamespace]:
    """SGLang's FlattenedTensorBucket, LocalSerializedTensor, MultiprocessingSerializer and
    weight-checker checksums (skips the test when the wheel is not installed)."""
    require_wheel()
    before = {name for name in sys.modules if name == "sglang" or name.startswith("sglang.")}
    assert not before, f"a real sglang is imported ({sorted(before)[:3]}); this loader would shadow it"
    for name in ("sglang", "sglang.srt", "sglang.srt.weight_sync", "sglang.srt.model_executor",
                 "sglang.srt.model_executor.model_runner_components", "sglang.srt.utils", "sglang.srt.managers"):
        sys.modules[name] = _package(name)
    try:
        tensor_bucket = importlib.import_module("sglang.srt.weight_sync.tensor_bucket")
        import pybase64

        serializer = _from_source(COMMON_MODULE, "MultiprocessingSerializer", {
            "io": io, "ForkingPickler": ForkingPickler, "pybase64": pybase64})
        local_tensor = _from_source(UPDATER_MODULE, "LocalSerializedTensor", {
            "dataclass": dataclass, "List": list, "MultiprocessingSerializer": serializer})
        tensor_hash = _from_source(HASH_MODULE, "tensor_hash", {"hashlib": hashlib, "torch": torch})
        checker = {"hashlib": hashlib, "Dict": dict, "tensor_hash": tensor_hash}
        yield types.SimpleNamespace(FlattenedTensorBucket=tensor_bucket.FlattenedTensorBucket,
                                    LocalSerializedTensor=local_tensor, MultiprocessingSerializer=serializer,
                                    hash_tensor=_from_source(CHECKER_MODULE, "_hash_tensor", checker),
                                    overall_checksum=_from_source(CHECKER_MODULE, "overall_checksum", checker))
    finally:
        for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
            del sys.modules[name]


def require_wheel() -> None:
    """Skip the test when the wheel's files are missing (fail where CI requires them)."""
    if not (WHEEL_DIR / f"sglang-{SGLANG_VERSION}.dist-info").is_dir():
        message = (f"sglang {SGLANG_VERSION} wheel files not at {WHEEL_DIR}: run scripts/test.sh, which installs "
                   f"them (pip install --no-deps --target .peer/sglang sglang=={SGLANG_VERSION})")
        if os.environ.get("WEIGHTSYNC_REQUIRE_PEERS") == "1":  # set by scripts/test.sh: CI never skips these
            pytest.fail(message, pytrace=False)
        pytest.skip(message)


HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
_ROUTE_DECORATORS = {"get": ["GET"], "post": ["POST"], "put": ["PUT"], "delete": ["DELETE"]}


def route_auth_levels() -> dict[tuple[str, str], str]:
    """(path, method) -> the auth level SGLang's HTTP server declares for it: "normal",
    "admin_optional" or "admin_force" (`@auth_level(AuthLevel.X)` on the endpoint, read from
    the wheel's `http_server.py`; none means "normal", as `sglang.srt.utils.auth` resolves it),
    or "health" for the paths `decide_request_auth` always lets through. Routes whose path
    is not a literal (set from the environment) are left out."""
    require_wheel()
    tree = ast.parse((WHEEL_DIR / HTTP_SERVER).read_text())
    levels: dict[tuple[str, str], str] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        level = "normal"
        routes: list[tuple[str, list[str]]] = []
        for decorator in node.decorator_list:
            if not isinstance(decorator, ast.Call):
                continue
            func = ast.unparse(decorator.func)
            if func == "auth_level":
                level = ast.unparse(decorator.args[0]).removeprefix("AuthLevel.").lower()
            elif func.startswith("app.") and decorator.args and isinstance(decorator.args[0], ast.Constant):
                verb = func.removeprefix("app.")
                methods = _ROUTE_DECORATORS.get(verb)
                for keyword in decorator.keywords:
                    if verb == "api_route" and keyword.arg == "methods":
                        methods = ast.literal_eval(keyword.value)
                if methods is not None:
                    routes.append((decorator.args[0].value, methods))
        for path, methods in routes:
            always = path.startswith(("/health", "/ready", "/metrics"))  # decide_request_auth's exemption
            for method in methods:
                levels[(path, method)] = "health" if always else level
    return levels


def b64(data: bytes) -> str:
    """What verl's HTTP adapter does with each serialized entry."""
    return base64.b64encode(data).decode("utf-8")
