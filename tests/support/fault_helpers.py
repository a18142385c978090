"""Checks shared by the fault-injection tests (imported by name; fixtures live in
`fault_fixtures`)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from weightsync_tools.faults import MARGIN_S, FaultOutcome

READ_ONLY = {"/health", "/health_generate", "/model_info", "/get_model_info", "/get_weight_version", "/generate",
             "/weightsync/info", "/weightsync/digests", "/server_info", "/get_server_info"}
"""Routes anyone may call when an admin key is set (SGLang's `AuthLevel.NORMAL` and health routes,
and weightsync's own read-only ones); every other route needs the key."""

def app_routes() -> dict[str, set[str]]:
    """path -> methods of every route of `weightsync serve` (from its own route table)."""
    from weightsync.server.app import create_app
    from weightsync.server.config import ServerConfig

    stub = SimpleNamespace(config=ServerConfig(model_dir=Path(".")), updater=None, scheduler=None, lora_store=None,
                           runner=None)
    app = create_app(stub)  # type: ignore[arg-type]
    return {r.path: set(r.methods) for r in app.routes if hasattr(r, "methods")}  # type: ignore[attr-defined]


def assert_survived(out: FaultOutcome, *, errors: tuple[str, ...] = (), needles: tuple[str, ...] = (),
                    status: int | None = None, restarted: bool = False) -> None:
    """Every guarantee for one injected fault, each with its own message."""
    where = f"{out.fault} over {out.transport}{' ' + str(out.notes) if out.notes else ''}"
    assert not out.hung, f"{where}: the push hung (no answer within {out.bound_s + MARGIN_S:.0f}s)"
    if out.expects_error:
        assert out.error_type in errors, f"{where}: expected one of {errors}, got {out.error_type}: {out.error}"
        assert any(n in out.error for n in needles) or not needles, f"{where}: {needles} not in {out.error!r}"
        assert status is None or out.status == status, f"{where}: HTTP {out.status}, expected {status}: {out.error}"
        assert out.seconds <= out.bound_s, f"{where}: the error took {out.seconds:.1f}s > {out.bound_s:.1f}s"
    if restarted:
        assert out.kept_last_good is None
    else:
        assert out.kept_last_good is True, (
            f"{where}: the engine does not serve its last good version bit-identically: {out.versions}, {out.notes}")
    assert out.generates is True, f"{where}: the engine did not generate with the version it serves"
    assert out.bad_version_dirs == [], f"{where}: incomplete version directories: {out.bad_version_dirs}"
    assert out.next_push, f"{where}: the next push failed: {out.next_push_error}"
    assert out.versions_went_back == 0, f"{where}: versions went backwards: {out.versions} {out.watched_versions}"
    assert out.lost_acked == 0, f"{where}: an acked version is not what the engine serves"
    assert out.survived  # and so the benchmark counts it
