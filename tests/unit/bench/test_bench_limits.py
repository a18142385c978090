"""The machine limits move the bytes they say they move, and leave nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from weightsync_tools.bench import limits

MiB = 1 << 20


def test_chunks_cover_the_bytes_exactly() -> None:
    spans = limits._chunks(10, 4)
    assert spans == [(0, 4), (4, 8), (8, 10)]


@pytest.mark.parametrize("name", ["copy", "xxh3", "gloo", "tcp", "disk"])
def test_each_limit_reports_its_bytes_and_runs(name: str, tmp_path: Path) -> None:
    found = limits.measure_limits(3 * MiB, MiB, directory=tmp_path, repeats=2, names=(name,))
    limit = found[name]
    assert (limit.name, limit.num_bytes, limit.chunk_bytes) == (name, 3 * MiB, MiB)
    assert len(limit.runs) == {"disk": 1, "copy": 5, "xxh3": 5}.get(name, 2)
    assert limit.seconds == min(limit.runs) > 0
    assert limit.gbps == pytest.approx(3 * MiB / limit.seconds / 1e9)
    assert set(limit.to_dict()) >= {"name", "num_bytes", "seconds", "gbps", "runs"}
    assert list(tmp_path.iterdir()) == []  # the disk limit removes its file


def test_unknown_limit_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown limit"):
        limits.measure_limits(MiB, MiB, directory=tmp_path, names=("nvlink",))
