"""The command line: tiny-model, inspect, usage errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from fresh_import import fresh_import
from weightsync.cli.main import main


def test_tiny_model_then_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tiny-model", str(tmp_path / "m"), "--layers", "1", "--json"]) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["hidden_size"] == 128 and made["weights_bytes"] > 0
    assert main(["inspect", str(tmp_path / "m"), "--bucket-bytes", "64KiB", "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest["format"] == "weightsync.manifest"
    assert all(b["nbytes"] <= 64 << 10 or len(b["tensors"]) == 1 for b in manifest["buckets"])
    assert main(["inspect", str(tmp_path / "m")]) == 0
    assert "bucket(s)" in capsys.readouterr().out


def test_inspect_missing_dir_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path)]) == 1
    assert "no *.safetensors" in capsys.readouterr().err


def test_usage_errors_exit_2() -> None:
    with pytest.raises(SystemExit) as e:
        main(["tiny-model"])
    assert e.value.code == 2
    assert main([]) == 2


def test_python_dash_m() -> None:
    ran = fresh_import()  # `python -m weightsync --help` in a fresh interpreter
    assert ran.help_exit == 0 and "tiny-model" in ran.help


@pytest.mark.parametrize("command", [["demo", "--steps", "1"], ["bench", "--quick"]])
def test_tools_subcommands_without_the_tools_extra(command: list[str], monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Without matplotlib (a module set to None cannot be found or imported), `weightsync
    demo` and `weightsync bench` fail at once, naming what is missing and how to install it."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(command) == 1
    err = capsys.readouterr().err
    assert "matplotlib" in err and "pip install 'weightsync[tools]'" in err, err
