"""Pushes from a trainer on two hosts (FSDP2, one rank per host) across shaped links: does sending
every rank's own share (`send_shares=True`) beat gathering to rank 0?

    sudo python -m weightsync_tools.bench.multihost_shares [--rate-gbit 1] [--engine-rate-gbit 2]

Cases (single, fsdp gather, fsdp shares, and both relayed to 4 replicas), each the best of
`--repeats`; prints a table and one JSON line. Needs root; removes what it made. The rig, the
cases and the figures: docs/SCALE.md ("Every trainer rank sends its own share").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from weightsync_tools.bench.multihost import add_push_options, bench_model, cannot_run, report
from weightsync_tools.netns import Network, remove_stale

BUCKET_BYTES = 8 << 20
"""Buckets small enough that a relay's hops add little for the bench's small model."""
CASES = [("single", 1, False, "direct", 1), ("fsdp gather", 2, False, "direct", 1),
         ("fsdp shares", 2, True, "direct", 1), ("single relay", 1, False, "relay", 4),
         ("fsdp shares relay", 2, True, "relay", 4)]
"""(name, trainer ranks, send_shares, fan_out, replicas)."""
PORT = 29611


def rank(spec: dict[str, Any]) -> int:
    """One trainer rank: build the model (FSDP2 over the ranks), push it; rank 0 prints the result."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import weightsync as ws

    world, me = spec["world"], spec["rank"]
    # the ranks share this machine's cores: oversubscribed, torch's OpenMP copies spin (a 31 MB
    # copy took 0.3 s with 2 threads in each of 2 ranks on 2 cores, 0.01 s with 1)
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))  # the cores this process may use
    group = None
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", init_method=spec["init"], rank=me, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        group = dist.group.WORLD
    times = []
    with ws.WeightSync([ws.SGLangEngine(u) for u in spec["engines"]], transport="http",
                       bucket_bytes=BUCKET_BYTES, timeout_s=300, pause="none", fan_out=spec["fan_out"],
                       send_shares=spec["send_shares"], process_group=group) as sync:
        for i in range(1 + spec["repeats"]):
            report = sync.push(model, version=spec["first_version"] + i)
            assert report.verified, report
            times.append(report.seconds)
    if me == 0:
        print(json.dumps({"seconds": min(times[1:]), "num_bytes": report.num_bytes,
                          "stages": report.stages.to_dict()}), flush=True)
    sys.stdout.flush()
    os._exit(0)  # FSDP2's gloo group outlives destroy_process_group (tests/distributed/conftest.py)


def run(rate_gbit: float, engine_rate_gbit: float, model_mb: int, repeats: int) -> dict[str, Any]:
    from weightsync.server.launch import launch_server

    trainers = ["trainer0", "trainer1"]
    engine_hosts = [f"engine{i}" for i in range(max(c[4] for c in CASES))]
    results: dict[str, Any] = {"rate_gbit": rate_gbit, "engine_rate_gbit": engine_rate_gbit, "cases": []}
    remove_stale()
    with tempfile.TemporaryDirectory(prefix="weightsync-shares-") as scratch, \
            Network([*trainers, *engine_hosts]) as net:
        model_dir = bench_model(Path(scratch) / "model", model_mb)
        for host, rate in [*((h, rate_gbit) for h in trainers), *((h, engine_rate_gbit) for h in engine_hosts)]:
            net.shape(host, rate_bits=rate * 1e9, burst_bytes=max(1 << 20, int(rate * 1e9 / 8 / 250)))
        servers = [launch_server(model_dir, args=["--host", net.address(h), "--num-threads", "1"],
                                 prefix=net.prefix(h)) for h in engine_hosts]
        try:
            version = 1
            for i, (name, world, shares, fan_out, replicas) in enumerate(CASES):
                spec = {"model_dir": str(model_dir), "engines": [s.url for s in servers[:replicas]],
                        "world": world, "send_shares": shares, "fan_out": fan_out, "repeats": repeats,
                        "first_version": version, "init": f"tcp://{net.address('trainer0')}:{PORT + i}"}
                line = _run_ranks(net, trainers[:world], spec)
                results["cases"].append({"case": name, "ranks": world, "replicas": replicas, **json.loads(line)})
                version += 1 + repeats
        finally:
            for s in servers:
                s.close()
    return results


def _run_ranks(net: Network, hosts: list[str], spec: dict[str, Any]) -> str:
    """Run one rank per host; rank 0's JSON line. A rank that fails ends the others."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "eth0"}  # not the hostname's loopback
    with tempfile.TemporaryDirectory() as logs:
        outs = [Path(logs, f"rank{r}.out") for r in range(len(hosts))]
        procs = [subprocess.Popen([*net.prefix(h), sys.executable, "-m", "weightsync_tools.bench.multihost_shares",
                                   "rank", json.dumps({**spec, "rank": r})],
                                  stdout=outs[r].open("w"), stderr=subprocess.STDOUT, text=True, env=env)
                 for r, h in enumerate(hosts)]
        deadline = time.monotonic() + 1800
        try:
            while any(p.poll() is None for p in procs):
                if any(p.returncode for p in procs) or time.monotonic() > deadline:
                    raise RuntimeError("a trainer rank failed:\n" + "\n".join(o.read_text()[-3000:] for o in outs))
                time.sleep(0.2)
            if any(p.returncode for p in procs):
                raise RuntimeError("a trainer rank failed:\n" + "\n".join(o.read_text()[-3000:] for o in outs))
            return next(x for x in outs[0].read_text().splitlines() if x.startswith("{"))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


def format_table(results: dict[str, Any]) -> str:
    single = {c["replicas"]: c["seconds"] for c in results["cases"] if c["ranks"] == 1}
    lines = [f"trainer hosts at {results['rate_gbit']:g} Gbit/s, engine hosts at {results['engine_rate_gbit']:g} "
             "Gbit/s", f"{'case':>18} {'ranks':>5} {'replicas':>8} {'seconds':>8} {'x single':>8}"]
    for c in results["cases"]:
        base = single.get(c["replicas"])
        ratio = f"{c['seconds'] / base:>8.2f}" if base else f"{'-':>8}"
        lines.append(f"{c['case']:>18} {c['ranks']:>5} {c['replicas']:>8} {c['seconds']:>8.2f} {ratio}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["rank"]:
        return rank(json.loads(argv[1]))
    parser = argparse.ArgumentParser(prog="python -m weightsync_tools.bench.multihost_shares", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate-gbit", type=float, default=1.0, help="each trainer host's link (default 1)")
    parser.add_argument("--engine-rate-gbit", type=float, default=2.0, help="each engine host's link (default 2)")
    add_push_options(parser)
    args = parser.parse_args(argv)
    if cannot_run():
        return 1
    results = run(args.rate_gbit, args.engine_rate_gbit, args.model_mb, args.repeats)
    return report(results, format_table(results))


if __name__ == "__main__":
    sys.exit(main())
