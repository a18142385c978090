"""The answer channel of the vLLM weight-transfer backend (`engines.vllm.transfer_answers`), both kinds:
every worker's answer to the call it names is read back; a missing or older one is an
error naming the rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from weightsync.engines.vllm.transfer_answers import AnswerBox, AnswerWriter
from weightsync.errors import EngineError


@pytest.mark.parametrize("kind", ["dir", "store"])
def test_answers_are_read_by_call_and_rank(kind: str, tmp_path: Path) -> None:
    box = AnswerBox(directory=str(tmp_path)) if kind == "dir" else AnswerBox(store_host="127.0.0.1")
    try:
        assert box.channel["kind"] == kind
        writers = [AnswerWriter(box.channel, rank=rank) for rank in range(2)]
        for rank, writer in enumerate(writers):
            writer.write(7, {"ok": True, "num_ranks": 2, "note": f"from {rank}"})
        answers = box.read(7, num_ranks=2, who="engine", what="init")
        assert [(a["rank"], a["seq"], a["note"]) for a in answers] == [(0, 7, "from 0"), (1, 7, "from 1")]
        writers[0].write(8, {"ok": False, "error": {"type": "IntegrityError", "message": "bad"}})
        with pytest.raises(EngineError, match="worker rank 1 left the answer to call 7 .*not the answer to call 8"):
            box.read(8, num_ranks=2, who="engine", what="update_weights")
        writers[1].write(8, {"ok": True})
        assert [a["ok"] for a in box.read(8, num_ranks=2, who="engine", what="update_weights")] == [False, True]
        with pytest.raises(EngineError, match="worker rank 2 left no answer"):
            box.read(8, num_ranks=3, who="engine", what="update_weights")
    finally:
        box.close()


def test_an_unknown_channel_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown answer channel"):
        AnswerWriter({"kind": "carrier-pigeon"}, rank=0)
