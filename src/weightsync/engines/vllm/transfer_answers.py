"""The answer channel of the `"weightsync"` weight-transfer backend: each worker's answer to each call,
carried beside vLLM (whose RL calls return none to the trainer).

Both ends: `AnswerWriter` in the workers, `AnswerBox` in the trainer; a directory both can read,
or a TCP store the trainer hosts. Why and how: docs/VLLM.md, "The answer channel".
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from weightsync.errors import EngineError

STORE_TIMEOUT_S = 30.0
"""How long a worker's write to the trainer's store may take (the trainer may be gone)."""


def _key(rank: int) -> str:
    return f"rank-{rank}"


class AnswerWriter:
    """One worker's end of a channel (`AnswerBox.channel`): write the answer to call `seq`."""

    def __init__(self, channel: Mapping[str, Any], *, rank: int) -> None:
        self.channel = dict(channel)
        self.rank = rank
        self._store: Any = None
        if channel.get("kind") == "store":
            import torch.distributed as dist

            self._store = dist.TCPStore(str(channel["host"]), int(channel["port"]), is_master=False,
                                        timeout=timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False)
        elif channel.get("kind") != "dir":
            raise ValueError(f"unknown answer channel {dict(channel)}; expected kind 'dir' or 'store'")

    def write(self, seq: int, answer: Mapping[str, Any]) -> None:
        """Replace this worker's answer with `answer` to call `seq`."""
        text = json.dumps({**answer, "seq": seq, "rank": self.rank})
        if self._store is not None:
            self._store.set(_key(self.rank), text)
            return
        path = Path(self.channel["path"]) / f"{_key(self.rank)}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


class AnswerBox:
    """The trainer's end: a channel the workers answer on, and the reading of answers.

    `directory`: answer in files there (default: a temporary directory, removed at
    `close`); `store_host`: answer in a TCP store this process hosts on that address
    of this host (reachable from the workers) instead.
    """

    def __init__(self, *, directory: str | None = None, store_host: str | None = None) -> None:
        self._store: Any = None
        self._own_dir: str | None = None
        if store_host is not None:
            import torch.distributed as dist

            self._store = dist.TCPStore(store_host, 0, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=STORE_TIMEOUT_S))
            self.channel: dict[str, Any] = {"kind": "store", "host": store_host, "port": int(self._store.port)}
        else:
            if directory is None:
                directory = self._own_dir = tempfile.mkdtemp(prefix="weightsync-vllm-answers-")
            self.channel = {"kind": "dir", "path": str(directory)}

    def read(self, seq: int, *, num_ranks: int, who: str, what: str) -> list[dict[str, Any]]:
        """Every worker's answer to call `seq`, rank by rank; EngineError naming the rank
        that wrote none (or an older one): its worker did not run the backend's verb."""
        return [self._read_one(seq, rank, who=who, what=what) for rank in range(num_ranks)]

    def _read_one(self, seq: int, rank: int, *, who: str, what: str) -> dict[str, Any]:
        answer: Any = None
        if self._store is not None:
            if self._store.check([_key(rank)]):
                answer = json.loads(self._store.get(_key(rank)))
            where = f"the trainer's answer store {self.channel['host']}:{self.channel['port']}"
        else:
            path = Path(self.channel["path"]) / f"{_key(rank)}.json"
            if path.exists():
                answer = json.loads(path.read_text())
            where = str(path)
        if isinstance(answer, dict) and answer.get("seq") == seq:
            return answer
        found = "no answer" if answer is None else f"the answer to call {answer.get('seq')}"
        raise EngineError(who, f"{what}: worker rank {rank} left {found} in {where}, not the answer to call {seq}; "
                          "is vLLM started with weight_transfer_config={'backend': 'weightsync'} "
                          "(--weight-transfer-config) and weightsync's vLLM plugin installed, and can its workers "
                          "reach the answer channel (answer_dir on a shared filesystem, or answer_host)?")

    def close(self) -> None:
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
        self._store = None


__all__ = ["AnswerBox", "AnswerWriter"]
