"""`weightsync tiny-model DIR`: write a small causal LM with an offline tokenizer."""

from __future__ import annotations

import argparse
import json
import sys

EPILOG = """examples:
  weightsync tiny-model /tmp/tiny
  weightsync tiny-model /tmp/tiny-llama --arch llama --layers 4 --heads 4 --tie
  weightsync tiny-model /tmp/tiny-bf16 --dtype bfloat16 --json
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tiny-model",
        help="write a tiny causal LM (Qwen2 or Llama, head_dim 64) with a tokenizer built offline",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dir", help="output directory (created if missing)")
    p.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--heads", type=int, default=2, help="attention heads; hidden = heads * 64 (default 2)")
    p.add_argument("--kv-heads", type=int, default=1, help="key/value heads (default 1)")
    p.add_argument("--intermediate", type=int, default=256, help="MLP width (default 256)")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size, >= 300 (default 512)")
    p.add_argument("--tie", action="store_true", help="tie input embeddings and LM head")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def run(args: argparse.Namespace) -> int:
    from weightsync.tiny import TinyModelConfig, make_tiny_model

    cfg = TinyModelConfig(
        arch=args.arch, num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
        intermediate_size=args.intermediate, vocab_size=args.vocab, tie_word_embeddings=args.tie,
        dtype=args.dtype, seed=args.seed,
    )
    try:
        out = make_tiny_model(args.dir, cfg)
    except ValueError as e:
        print(f"weightsync tiny-model: {e}", file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    if args.json:
        print(json.dumps({"dir": str(out), "weights_bytes": size, "hidden_size": cfg.hidden_size}))
    else:
        print(f"wrote {cfg.arch} model to {out} ({size / 1e6:.2f} MB of weights, hidden {cfg.hidden_size})",
              file=sys.stderr)
    return 0
