"""`weightsync serve`: the embedded engine, a CPU inference server speaking
SGLang's weight-update API plus weightsync's `/weightsync/*` routes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EPILOG = """\
examples:
  weightsync serve --model ./tiny                      # 127.0.0.1, a free port
  weightsync serve --model ./tiny --port 30000 --admin-api-key secret
  weightsync serve --model ./tiny --enable-lora --max-loaded-loras 4 --disk-root /mnt/ckpt

The first line on stdout is 'weightsync serve listening on http://HOST:PORT'.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="run the embedded engine (CPU inference server with SGLang's weight-update API)",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, type=Path,
                   help="Hugging Face model directory (a compressed-tensors int8 or fp8-block checkpoint is served "
                        "dequantized; pushes into it arrive quantized: docs/QUANTIZED.md)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="TCP port; 0 picks a free one (default 0)")
    p.add_argument("--admin-api-key", default=None, help="require 'Authorization: Bearer KEY' on mutating routes")
    p.add_argument("--enable-lora", action="store_true", help="accept LoRA adapters, route requests by lora_path")
    p.add_argument("--max-loaded-loras", type=int, default=4, help="adapters kept loaded (LRU beyond; default 4)")
    p.add_argument("--disk-root", type=Path, default=None,
                   help="disk updates and adapter dirs must resolve under this (default: the model dir's parent)")
    p.add_argument("--weight-version", default="0",
                   help="initial weight_version label; an integer also starts weightsync's version there (default 0)")
    p.add_argument("--session-timeout", type=float, default=60.0,
                   help="seconds an idle update session survives a competing begin, for trainers "
                        "that send no timeout of their own (default 60)")
    p.add_argument("--staging-bytes-limit", type=int, default=None,
                   help="bytes a staged update may take beyond what the engine holds at begin, where the "
                        "host's MemAvailable overstates what this process may use (a container's cgroup "
                        "limit); a staged push that needs more is refused at begin (default: MemAvailable "
                        "less a 256 MiB margin)")
    p.add_argument("--max-running", type=int, default=16, help="requests stepped together (default 16)")
    p.add_argument("--group-timeout", type=float, default=120.0,
                   help="seconds to join a weight-update group or finish a broadcast (default 120)")
    p.add_argument("--sglang-only", action="store_true",
                   help="serve only SGLang's own API, as a stock SGLang does: no /weightsync/* routes "
                        "(for testing clients against SGLang's surface)")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice; 1 is fastest for tiny models)")
    return p


def run(args: argparse.Namespace) -> int:
    from weightsync.server.config import ServerConfig
    from weightsync.server.serving import serve

    if not (args.model / "config.json").is_file():
        print(f"error: {args.model} is not a model directory (no config.json)", file=sys.stderr)
        return 2
    config = ServerConfig(
        model_dir=args.model,
        host=args.host,
        port=args.port,
        admin_api_key=args.admin_api_key,
        enable_lora=args.enable_lora,
        max_loaded_loras=args.max_loaded_loras,
        disk_root=args.disk_root,
        weight_version=args.weight_version,
        session_timeout_s=args.session_timeout,
        staging_bytes_limit=args.staging_bytes_limit,
        max_running=args.max_running,
        group_timeout_s=args.group_timeout,
        num_threads=args.num_threads,
        weightsync_routes=not args.sglang_only,
    )

    def announce(url: str) -> None:
        print(f"weightsync serve listening on {url}", flush=True)

    serve(config, on_listening=announce)
    return 0
