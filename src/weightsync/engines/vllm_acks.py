"""The answer channel of weightsync's vLLM weight-transfer backend: one file per worker.

vLLM's weight-transfer verbs (`init_weight_transfer_engine`, `start_weight_update`,
`update_weights`, `finish_weight_update`) return nothing to the trainer: the
in-process `LLM` methods return None, the HTTP routes return fixed messages,
and vLLM's HTTP client drops the 500 body that holds a worker's error. So every
worker of the `"weightsync"` backend writes its answer to each call (its ack,
its refusal with the error's type and fields) to `<ack_dir>/rank-<r>.json`,
atomically (write, fsync, rename), and the trainer reads it after the call
returned. Both ends live here: `AckWriter` in the workers
(`engines.vllm_transfer`), `read_answers` in the trainer
(`engines.vllm_transfer_client`).

Calls are numbered by the trainer (`seq`); an answer names the call it
answers, so a file left from an earlier call is never taken for the current
one. `ack_dir` is a directory both sides can read: a temporary directory on
the trainer's host where the engine runs there (in process, shm, broadcast on
one host), a directory on the shared filesystem otherwise (the disk
transport's root is one).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from weightsync.errors import EngineError

ANSWER_FILE = "rank-{rank}.json"


class AckWriter:
    """One worker's end: write the answer to call `seq`."""

    def __init__(self, ack_dir: str | Path, *, rank: int) -> None:
        self.path = Path(ack_dir) / ANSWER_FILE.format(rank=rank)
        self.rank = rank

    def write(self, seq: int, answer: dict[str, Any]) -> None:
        """Replace this worker's answer file with `answer` to call `seq` (atomic rename)."""
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w") as f:
            json.dump({**answer, "seq": seq, "rank": self.rank}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def read_answers(ack_dir: str | Path, seq: int, *, num_ranks: int, who: str, what: str) -> list[dict[str, Any]]:
    """Every worker's answer to call `seq`, rank by rank; EngineError naming the rank that
    wrote none (or an older one): its worker did not run the `"weightsync"` backend's verb."""
    answers = []
    for rank in range(num_ranks):
        path = Path(ack_dir) / ANSWER_FILE.format(rank=rank)
        try:
            answer = json.loads(path.read_text())
        except FileNotFoundError:
            answer = None
        if not isinstance(answer, dict) or answer.get("seq") != seq:
            found = "no answer" if answer is None else f"the answer to call {answer.get('seq')}"
            raise EngineError(who, f"{what}: worker rank {rank} left {found} in {path}, not the answer to call "
                              f"{seq}; is vLLM started with weight_transfer_config={{'backend': 'weightsync'}} "
                              "(--weight-transfer-config) and weightsync's vLLM plugin installed, and can its "
                              "workers write to that directory?")
        answers.append(answer)
    return answers


__all__ = ["ANSWER_FILE", "AckWriter", "read_answers"]
