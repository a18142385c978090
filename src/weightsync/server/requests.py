"""One generation request's state, its stop conditions and its SGLang-shaped answer.

A `GenRequest` is created by the HTTP layer, advanced by the scheduler one
token per step, and finished exactly once (length, stop or abort). It knows
token ids only; decoding to text goes through the `decode` callable it is
given, so this module does not depend on a tokenizer.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.server.sampling import SamplingParams

_ids = itertools.count()


def new_rid() -> str:
    return f"req-{next(_ids)}"


FinishReason = dict[str, Any]
Decode = Callable[[list[int]], str]


@dataclass(frozen=True)
class ServedVersion:
    """Which weights a forward pass ran with. Two schemes meet here: weightsync's
    own integer order and SGLang's free-string label."""

    version: int
    """weightsync's version: +1 per applied update (a push sets its own), never backwards."""
    label: str
    """SGLang's `weight_version`: whatever string the last update or
    `/update_weight_version` gave ("v1", "step_10", the same on several updates)."""


@dataclass(eq=False)
class VersionSpan:
    """Output tokens [start, end) of one request, computed with `served`."""

    served: ServedVersion
    start: int
    end: int

    def to_json(self) -> dict[str, Any]:
        """SGLang's `meta_info.weight_versions` entry, plus weightsync's integer version."""
        return {"version": self.served.label, "start": self.start, "end": self.end,
                "weightsync_version": self.served.version}


@dataclass(eq=False)
class GenRequest:
    """A request in flight. Mutated only by the scheduler thread (and by pause
    handling between two steps)."""

    rid: str
    """Request id (SGLang's `rid`)."""
    prompt_ids: list[int]
    """Prompt token ids."""
    params: SamplingParams
    """Sampling parameters."""
    return_logprob: bool = False
    """Report output token logprobs."""
    logprob_start_len: int = -1
    """Report prompt token logprobs from this position (-1: none)."""
    adapter_name: str | None = None
    """LoRA adapter name (`lora_path` in SGLang's API), None for the base model."""
    adapter: Any = None
    """The adapter handle the request holds a reference on (lora.Adapter)."""
    generator: torch.Generator | None = None
    """Sampling generator (None for greedy)."""
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    spans: list[VersionSpan] = field(default_factory=list)
    """Which weights computed which output tokens, in order; a new span starts
    whenever the version or the label changed between two steps."""
    cache: Any = None
    """KV cache covering every token but the last generated one; None = recompute."""
    finish_reason: FinishReason | None = None
    text: str = ""
    on_done: Callable[[GenRequest], None] | None = None
    """Called once, from the thread that finished the request."""
    _done_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def record_served(self, served: ServedVersion) -> None:
        """The newest output token was computed with `served`."""
        num_tokens = len(self.output_ids)
        if self.spans and self.spans[-1].served == served:
            self.spans[-1].end = num_tokens
        else:
            start = self.spans[-1].end if self.spans else 0
            self.spans.append(VersionSpan(served, start, num_tokens))

    def pending_ids(self) -> list[int]:
        """Tokens the next forward pass must feed: all of them without a cache,
        else only the last generated token."""
        if self.cache is None:
            return self.all_ids
        return self.output_ids[-1:]

    def finish(self, reason: FinishReason, decode: Decode | None = None) -> None:
        """Mark finished (first call wins) and notify the waiter."""
        with self._done_lock:
            if self.finish_reason is not None:
                return
            self.finish_reason = reason
        self.cache = None
        if decode is not None:
            self.text = _cut_at_stop(decode(self.output_ids), self.params.stop)
        if self.on_done is not None:
            self.on_done(self)


def _cut_at_stop(text: str, stops: Collection[str]) -> str:
    cut = min((i for s in stops if (i := text.find(s)) >= 0), default=-1)
    return text[:cut] if cut >= 0 else text


def stop_reason(req: GenRequest, token: int, eos_ids: Collection[int], decode: Decode) -> FinishReason | None:
    """Why `req` stops after appending `token`, or None to go on."""
    params = req.params
    if token in params.stop_token_ids:
        return {"type": "stop", "matched": token}
    if not params.ignore_eos and token in eos_ids:
        return {"type": "stop", "matched": token}
    if params.stop:
        text = decode(req.output_ids)
        for s in params.stop:
            if s in text:
                return {"type": "stop", "matched": s}
    if len(req.output_ids) >= params.max_new_tokens:
        return {"type": "length", "length": params.max_new_tokens}
    return None


def abort_reason(message: str) -> FinishReason:
    return {"type": "abort", "message": message}


def to_response(req: GenRequest, *, current: ServedVersion) -> dict[str, Any]:
    """The SGLang `/generate` answer for one finished request. `weight_version` is
    the label of the last forward pass (`current` for a request that never ran one);
    `weight_versions` are SGLang's spans, one per version or label the request saw."""
    spans = req.spans or [VersionSpan(current, 0, len(req.output_ids))]
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": 0,
        "weight_version": spans[-1].served.label,
        "weight_versions": [span.to_json() for span in spans],
        "lora_path": req.adapter_name,
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tok, None] for lp, tok in zip(req.output_logprobs, req.output_ids, strict=True)
        ]
        if req.input_logprobs is not None:
            start = max(req.logprob_start_len, 0)
            meta["input_token_logprobs"] = [
                [lp, tok, None] for lp, tok in zip(req.input_logprobs, req.prompt_ids[start:], strict=True)
            ]
    return {"text": req.text, "output_ids": list(req.output_ids), "meta_info": meta}


@dataclass(frozen=True)
class GenerateItem:
    """One prompt of a `/generate` call, parsed and validated."""

    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    adapter_name: str | None
    rid: str


def parse_generate(body: dict[str, Any], encode: Callable[[str], list[int]]) -> tuple[list[GenerateItem], bool]:
    """SGLang's `/generate` body -> items, and whether the input was a batch.

    `text` or `input_ids` (exactly one), each a single prompt or a list; the
    per-prompt fields may be a single value for all or a list of the same length.
    """
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise ValueError("give exactly one of 'text' and 'input_ids'")
    if text is not None:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not all(isinstance(t, str) for t in texts):
            raise ValueError("'text' must be a string or a list of strings")
        prompts: list[Any] = [encode(t) for t in texts]
    else:
        is_batch = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        prompts = list(input_ids or ()) if is_batch else [input_ids]
        for p in prompts:
            if not isinstance(p, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise ValueError("'input_ids' must be a list of integers or a list of such lists")
    n = len(prompts)
    if n == 0:
        raise ValueError("empty batch")
    sampling = _per_item(body.get("sampling_params"), n, "sampling_params", dict)
    rids = _per_item(body.get("rid"), n, "rid", str)
    adapters = _per_item(body.get("lora_path"), n, "lora_path", str)
    logprobs = _per_item(body.get("return_logprob", False), n, "return_logprob", bool)
    starts = _per_item(body.get("logprob_start_len", -1), n, "logprob_start_len", int)
    items = [
        GenerateItem(
            prompt_ids=list(prompts[i]),
            params=SamplingParams.from_json(sampling[i]),
            return_logprob=bool(logprobs[i]),
            logprob_start_len=int(starts[i] if starts[i] is not None else -1),
            adapter_name=adapters[i],
            rid=rids[i] or new_rid(),
        )
        for i in range(n)
    ]
    return items, is_batch


def _per_item(value: Any, n: int, key: str, kind: type) -> list[Any]:
    if isinstance(value, list) and kind is not list:
        if len(value) != n:
            raise ValueError(f"'{key}' has {len(value)} entries for {n} prompts")
        values = value
    else:
        values = [value] * n
    for v in values:
        if v is not None and not isinstance(v, kind):
            raise ValueError(f"'{key}' must be a {kind.__name__} (or a list of them), got {v!r:.80}")
    return values
