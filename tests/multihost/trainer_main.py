"""The trainer "host" of the multi-host rig: run inside the trainer's namespace as

    ip netns exec NS python trainer_main.py '{"model_dir": ..., "engines": [url, ...], "master_address": ...}'

It reads one JSON command per line on stdin and answers one JSON line on stdout
(logs go to stderr), so the test drives pushes, faults and checks step by step
while this process keeps its `WeightSync`s between them:

    {"op": "push", "sync": "b", "transport": "broadcast", "mode": "full", "version": 3, ["fan_out": "relay",]
     "fault": {"at_bucket": 1, "run": [argv...]} | {"at_bucket": 1, "kill": pid}
              | {"in_commit": 0, "kill": pid}}
    {"op": "serving", "engines": [0, 1]}    which pushed version each engine serves, by digests
    {"op": "build", "engine": 1, "transport": "shm", "options": {}}   construct a sync; its refusal
    {"op": "close", "sync": "b"}

Only the faults are injected (`FaultyTransport`'s "call" fault runs a command, e.g. a link cut, or
kills an engine, once, just before bucket `at_bucket` goes out; "in_commit": N runs it in the commit
round, just before engine N's commit goes out and after the other engine committed); the rest is
the public API against real servers on other "hosts".
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import httpx
import torch
from transformers import AutoModelForCausalLM

import weightsync as ws
from weightsync.integrity import digest
from weightsync.server.launch import wait_for_health
from weightsync.transports import make_transport
from weightsync_tools.faults.inject import FaultyTransport, fail_in_commit_round

PROMPTS = [[5, 17, 42, 7], [300, 2, 99], [11, 12, 13, 14]]
BUCKET_BYTES = 256 << 10
"""The tiny model (~1.7 MB) goes as several buckets, so a fault lands mid-stream."""


class Trainer:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32).eval()
        self.engines = [ws.SGLangEngine(url) for url in spec["engines"]]
        self.syncs: dict[str, ws.WeightSync] = {}
        self.lora_model: Any = None
        self.known: dict[int, dict[str, str]] = {0: self._digests()}
        """version -> digests of every base tensor pushed as that version (0: the model dir's)."""
        for url in spec["engines"]:
            wait_for_health(url, time.monotonic() + spec.get("start_timeout_s", 120.0))

    def _digests(self) -> dict[str, str]:
        return {name: digest(t.detach().contiguous()) for name, t in self.model.state_dict().items()
                if "rotary" not in name}

    def _peft(self) -> Any:
        if self.lora_model is None:
            from peft import LoraConfig, get_peft_model

            base = AutoModelForCausalLM.from_pretrained(self.spec["model_dir"], dtype=torch.float32)
            base.load_state_dict(self.model.state_dict())
            self.lora_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")).eval()
        return self.lora_model

    # -- ops ---------------------------------------------------------------------------------

    def push(self, cmd: dict[str, Any]) -> dict[str, Any]:
        mode, version, seed = cmd["mode"], cmd["version"], cmd.get("seed", cmd["version"])
        model = self._peft() if mode == "lora" else self.model
        _perturb(model, seed, lora=mode == "lora", only=cmd.get("only"))
        sync = self._sync(cmd)
        started = time.monotonic()
        try:
            report = sync.push(model, version=version)
        except ws.WeightSyncError as e:
            return {"ok": False, "error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - started}
        seconds = time.monotonic() - started
        if mode != "lora":
            self.known[version] = self._digests()
        return {"ok": True, "seconds": seconds, "verified": report.verified, "num_tensors": report.num_tensors,
                "num_bytes": report.num_bytes, "acks": [a.engine for a in report.acks],
                "served": [self._served(i, model, sync.lora_name if mode == "lora" else None)
                           for i in range(len(self.engines))]}

    def _sync(self, cmd: dict[str, Any]) -> ws.WeightSync:
        name = cmd["sync"]
        sync = self.syncs.get(name)
        if sync is None:
            transport = make_transport(cmd["transport"], timeout_s=cmd.get("timeout_s", 30.0),
                                       disk_root=self.spec.get("disk_root"),
                                       master_address=self.spec["master_address"],
                                       relay=cmd.get("fan_out") == "relay")
            sync = self.syncs[name] = ws.WeightSync(
                self.engines, transport=transport, mode=cmd["mode"], bucket_bytes=BUCKET_BYTES,
                timeout_s=cmd.get("timeout_s", 30.0), pause=cmd.get("pause", "retract"),
                fan_out=cmd.get("fan_out", "direct"))
        transport = sync._make_transport()
        if isinstance(transport, FaultyTransport):  # the last push's fault is spent
            transport = sync._transport = transport.inner
        sync._replicas.engines = list(self.engines)
        fault = cmd.get("fault")
        if fault is not None and "in_commit" in fault:
            victim = int(fault["in_commit"])
            sync._replicas.engines = fail_in_commit_round(self.engines, victim, 1 - victim, _action(fault))
        elif fault is not None:
            sync._transport = FaultyTransport(transport, "call", at_bucket=fault["at_bucket"],  # type: ignore[assignment]
                                              on_fire=_action(fault))
        return sync

    def _served(self, index: int, model: Any, lora_name: str | None) -> dict[str, Any]:
        """What engine `index` serves against the trainer: digests and greedy answers."""
        engine = self.engines[index]
        served = engine.digests()
        probe = ws.probe_logprobs(model, engine, PROMPTS, max_new_tokens=6, lora_name=lora_name)
        out = {"version": engine.weight_version(), "serves": _match(served, self.known),
               "token_agreement": probe.token_agreement, "max_gap": probe.max_gap}
        if lora_name is not None:
            with model.disable_adapter():
                base = ws.probe_logprobs(model, engine, PROMPTS, max_new_tokens=6, lora_name=lora_name)
            out["gap_without_adapter"] = base.max_gap
        else:
            expected = self._digests()
            out["digests_equal"] = all(served.get(n) == d for n, d in expected.items())
        return out

    def serving(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, "serves": [_match(self.engines[i].digests(), self.known) for i in cmd["engines"]],
                "versions": [self.engines[i].weight_version() for i in cmd["engines"]],
                "adapters": [httpx.get(f"{self.spec['engines'][i]}/weightsync/info").json()["loaded_loras"]
                             for i in cmd["engines"]]}

    def build(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Construct (and close) a sync to one engine with these options; its refusal."""
        try:
            ws.WeightSync([self.engines[cmd["engine"]]], transport=cmd["transport"], **cmd.get("options", {})).close()
        except ValueError as e:
            return {"ok": False, "error": str(e)}
        return {"ok": True}

    def close(self, cmd: dict[str, Any]) -> dict[str, Any]:
        sync = self.syncs.pop(cmd["sync"], None)
        if sync is not None:
            sync.close()
        return {"ok": True}


def _action(fault: dict[str, Any]) -> Callable[[], None]:
    if "kill" in fault:
        return lambda: os.kill(int(fault["kill"]), signal.SIGKILL)
    return lambda: subprocess.run(fault["run"], check=True, timeout=30)


def _perturb(model: Any, seed: int, *, lora: bool, only: str | None) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if lora:
                if "lora_B" in name or "lora_A" in name:
                    p.add_(noise * 0.1)
            elif only is None or only in name:
                p.add_(noise * 0.05)


def _match(served: dict[str, str], known: dict[int, dict[str, str]]) -> int | None:
    """The pushed version whose every base tensor the engine serves exactly (None: none)."""
    for version, digests in known.items():
        if all(served.get(n) == d for n, d in digests.items()):
            return version
    return None


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    trainer = Trainer(json.loads(sys.argv[1]))
    print(json.dumps({"ok": True, "ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        try:
            answer = getattr(trainer, cmd["op"])(cmd)
        except Exception as e:  # the test reads the traceback
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        print(json.dumps(answer), flush=True)
    for sync in trainer.syncs.values():
        sync.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
