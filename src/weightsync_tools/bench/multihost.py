"""Pushes across shaped links: a trainer host and engine hosts made of network namespaces
(`weightsync_tools.netns`), every host's link limited with `tc tbf` to the same rate.

    sudo python -m weightsync_tools.bench.multihost [--rates-gbit 1,5] [--replicas 1,2,4] [--model-mb 120]
                                                    [--cases broadcast,http,http-relay,broadcast-relay]

Per rate: raw TCP, and broadcast and http pushes (direct and relayed) to 1, 2, 4 replicas; prints a
table and one JSON line. Needs root; removes what it made. Cases and figures: docs/SCALE.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from weightsync_tools.netns import Network, remove_stale, unavailable

CHUNK = 4 << 20
BUCKET_BYTES = 64 << 20
RELAY_BUCKET_BYTES = 8 << 20
"""A relay's buckets: each hop forwards a bucket once it holds all of it, so a push takes
about the model over one link plus a bucket per hop; small buckets keep that second part
small for the bench's small model (a 140 GB model in 256 MiB buckets has over 500)."""
GROUP_RELAY_BUCKET_BYTES = 4 << 20
"""A relay in a broadcast group: its hops cost less per bucket than an HTTP request, so
smaller buckets pay (4 MiB: 1.25x the 1-replica push at 4 replicas, 8 MiB: 1.38x, on the
2-core rig at 1 Gbit/s); http relays fastest at 8 MiB."""
CASES = {"broadcast": ("broadcast", "direct", BUCKET_BYTES), "http": ("http", "direct", BUCKET_BYTES),
         "http-relay": ("http", "relay", RELAY_BUCKET_BYTES),
         "broadcast-relay": ("broadcast", "relay", GROUP_RELAY_BUCKET_BYTES)}
"""Case name -> (transport, fan_out, bucket bytes), pushed at every rate and replica count."""
RAW_BYTES = 256 << 20


# -- roles run inside namespaces ---------------------------------------------------------------


def sink(address: str, num_bytes: int) -> int:
    """Accept one connection on `address`, read `num_bytes`, answer one byte."""
    with socket.create_server((address, 0)) as server:
        print(server.getsockname()[1], flush=True)
        conn, _ = server.accept()
        with conn:
            buffer = bytearray(CHUNK)
            view, left = memoryview(buffer), num_bytes
            while left:
                got = conn.recv_into(view[: min(CHUNK, left)])
                if not got:
                    return 1
                left -= got
            conn.sendall(b"k")
    return 0


def raw(targets: list[str], num_bytes: int) -> int:
    """Send `num_bytes` to every "host:port" at once; print the seconds until every one answered."""
    payload = memoryview(bytearray(os.urandom(CHUNK)))
    conns = [socket.create_connection((h, int(p))) for h, p in (t.rsplit(":", 1) for t in targets)]

    def stream(conn: socket.socket) -> None:
        left = num_bytes
        while left:
            n = min(CHUNK, left)
            conn.sendall(payload[:n])
            left -= n
        conn.recv(1)

    started = time.perf_counter()
    threads = [threading.Thread(target=stream, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"seconds": time.perf_counter() - started}), flush=True)
    return 0


def trainer(spec: dict[str, Any]) -> int:
    """Push the model to the first n engines over each transport; print one JSON line per case."""
    import torch
    from transformers import AutoModelForCausalLM

    import weightsync as ws

    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    version = spec["first_version"]
    for transport, fan_out, bucket_bytes in spec["cases"]:
        for n in spec["replicas"]:
            engines = [ws.SGLangEngine(url) for url in spec["engines"][:n]]
            times = []
            with ws.WeightSync(engines, transport=transport, bucket_bytes=bucket_bytes, timeout_s=300,
                               master_address=spec["master_address"], pause="none", fan_out=fan_out) as sync:
                for _ in range(1 + spec["repeats"]):
                    report = sync.push(model, version=version)
                    version += 1
                    assert report.verified, report
                    times.append(report.seconds)
            print(json.dumps({"transport": transport, "fan_out": fan_out, "bucket_bytes": bucket_bytes,
                              "replicas": n, "seconds": min(times[1:]),
                              "num_bytes": report.num_bytes, "stages": report.stages.to_dict()}), flush=True)
    return 0


# -- the orchestrator ------------------------------------------------------------------------


def _python(net: Network, host: str, *args: str) -> list[str]:
    return [*net.prefix(host), sys.executable, "-m", "weightsync_tools.bench.multihost", *args]


def measure_raw(net: Network, hosts: list[str], num_bytes: int) -> float:
    sinks = [subprocess.Popen(_python(net, h, "sink", net.address(h), str(num_bytes)), stdout=subprocess.PIPE,
                              text=True) for h in hosts]
    try:
        ports = [s.stdout.readline().strip() for s in sinks if s.stdout is not None]
        targets = [f"{net.address(h)}:{p}" for h, p in zip(hosts, ports, strict=True)]
        done = subprocess.run(_python(net, "trainer", "raw", str(num_bytes), *targets), capture_output=True,
                              text=True, timeout=600, check=True)
        return float(json.loads(done.stdout)["seconds"])
    finally:
        for s in sinks:
            s.kill()
            s.wait()


def run(rates_gbit: list[float], replicas: list[int], model_mb: int, repeats: int,
        cases: list[str] | None = None) -> dict[str, Any]:
    from weightsync.server.launch import launch_server

    chosen = [CASES[c] for c in (cases or list(CASES))]
    engine_hosts = [f"engine{i}" for i in range(max(replicas))]
    results: dict[str, Any] = {"rates": []}
    remove_stale()
    with tempfile.TemporaryDirectory(prefix="weightsync-multihost-") as scratch, \
            Network(["trainer", *engine_hosts]) as net:
        model_dir = bench_model(Path(scratch) / "model", model_mb)
        servers = [launch_server(model_dir, args=["--host", net.address(h), "--num-threads", "1"],
                                 prefix=net.prefix(h)) for h in engine_hosts]
        try:
            version = 1
            for rate in rates_gbit:
                for h in ["trainer", *engine_hosts]:
                    net.shape(h, rate_bits=rate * 1e9, burst_bytes=max(1 << 20, int(rate * 1e9 / 8 / 250)))
                row: dict[str, Any] = {"rate_gbit": rate, "raw": {}, "pushes": []}
                for n in replicas:
                    seconds = measure_raw(net, engine_hosts[:n], RAW_BYTES)
                    row["raw"][n] = {"seconds": seconds, "gbit_per_replica": RAW_BYTES * 8 / seconds / 1e9}
                spec = {"model_dir": str(model_dir), "engines": [s.url for s in servers],
                        "master_address": net.address("trainer"), "replicas": replicas,
                        "cases": chosen, "repeats": repeats, "first_version": version}
                env = {**os.environ, "PYTHONUNBUFFERED": "1"}
                done = subprocess.run(_python(net, "trainer", "trainer", json.dumps(spec)), capture_output=True,
                                      text=True, timeout=1800, env=env)
                if done.returncode != 0:
                    raise RuntimeError(f"the trainer failed:\n{done.stderr[-4000:]}")
                row["pushes"] = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
                version += (1 + repeats) * len(replicas) * len(chosen)
                results["rates"].append(row)
        finally:
            for s in servers:
                s.close()
    return results


def bench_model(directory: Path, model_mb: int) -> Path:
    """A tiny Qwen2 of about `model_mb` MB of float32 weights, written to `directory`."""
    from weightsync.tiny import TinyModelConfig, make_tiny_model

    layers = max(1, round(model_mb / 15))  # ~15 MB of float32 per layer at hidden 512, MLP 2048
    return make_tiny_model(directory, TinyModelConfig(num_layers=layers, num_heads=8, num_kv_heads=2,
                                                      intermediate_size=2048, vocab_size=512))


def add_push_options(parser: argparse.ArgumentParser) -> None:
    """The options every multihost bench takes: the model's size and the pushes per case."""
    parser.add_argument("--model-mb", type=int, default=120, help="float32 model size, MB (default 120)")
    parser.add_argument("--repeats", type=int, default=2, help="timed pushes per case after a warm-up (default 2)")


def report(results: dict[str, Any], table: str) -> int:
    """The table on stderr, the results as one JSON line on stdout."""
    print(table, file=sys.stderr)
    print(json.dumps(results))
    return 0


def cannot_run() -> int:
    """1, saying why, where network namespaces cannot be made here; 0 where they can."""
    reason = unavailable()
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 1
    return 0


def format_table(results: dict[str, Any]) -> str:
    lines = [f"{'link':>6} {'what':>15} {'replicas':>8} {'seconds':>8} {'GB/s/replica':>12} {'trainer link':>12}"]
    for row in results["rates"]:
        rate = row["rate_gbit"]
        for n, raw_row in row["raw"].items():
            per = raw_row["gbit_per_replica"]
            lines.append(f"{rate:>5g}G {'raw tcp':>15} {n:>8} {raw_row['seconds']:>8.2f} {per / 8:>12.3f} "
                         f"{per * int(n) / rate:>11.0%}")
        for p in row["pushes"]:
            per = p["num_bytes"] / p["seconds"] / 1e9
            relayed = p.get("fan_out") == "relay"  # the trainer's link carries the model once
            what = f"{p['transport']} relay" if relayed else p["transport"]
            lines.append(f"{rate:>5g}G {what:>15} {p['replicas']:>8} {p['seconds']:>8.2f} {per:>12.3f} "
                         f"{per * 8 * (1 if relayed else p['replicas']) / rate:>11.0%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sink"]:
        return sink(argv[1], int(argv[2]))
    if argv[:1] == ["raw"]:
        return raw(argv[2:], int(argv[1]))
    if argv[:1] == ["trainer"]:
        return trainer(json.loads(argv[1]))
    parser = argparse.ArgumentParser(prog="python -m weightsync_tools.bench.multihost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates-gbit", default="1,5", help="link rates to shape to, Gbit/s (default 1,5)")
    parser.add_argument("--replicas", default="1,2,4", help="replica counts (default 1,2,4)")
    add_push_options(parser)
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"what to push, comma-separated (default {','.join(CASES)})")
    args = parser.parse_args(argv)
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; one of {', '.join(CASES)}")
    if cannot_run():
        return 1
    results = run([float(r) for r in args.rates_gbit.split(",")], [int(n) for n in args.replicas.split(",")],
                  args.model_mb, args.repeats, cases)
    return report(results, format_table(results))


if __name__ == "__main__":
    sys.exit(main())
