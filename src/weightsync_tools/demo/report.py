"""The demo's outputs: a per-step table, a PNG plot and a JSON report."""

from __future__ import annotations

import json
from pathlib import Path

from weightsync_tools.demo.run import DemoResult


def format_table(result: DemoResult) -> str:
    head = f"{'step':>4} {'ver':>4} {'reward':>7} {'sync s':>8} {'bytes':>9} {'GB/s':>7} {'verified':>8} {'lp gap':>9}"
    lines = [head, "-" * len(head)]
    for r in result.rows:
        lines.append(
            f"{r.step:>4} {r.version:>4} {r.reward:>7.3f} {r.sync_seconds:>8.4f} {r.sync_bytes:>9} "
            f"{r.gbps:>7.3f} {'yes' if r.verified else 'NO':>8} {r.logprob_gap:>9.2e}"
        )
    lines.append("-" * len(head))
    lines.append(
        f"reward {result.reward_start:.3f} -> {result.reward_end:.3f} (mean of first/last 5 steps); "
        f"{len(result.rows)} pushes, all verified: {all(r.verified for r in result.rows)}; "
        f"max logprob gap {max((r.logprob_gap for r in result.rows), default=0):.2e}; {result.seconds:.1f}s"
    )
    return "\n".join(lines)


def write_plot(result: DemoResult, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in result.rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax1.plot(steps, [r.reward for r in result.rows], marker="o", color="tab:green")
    ax1.set_ylabel("mean reward")
    ax1.set_title(f"weightsync demo: {result.config['mode']} over {result.config['transport']} "
                  f"to {result.config['engine']}")
    ax1.grid(alpha=0.3)
    ax2.bar(steps, [r.sync_seconds * 1000 for r in result.rows], color="tab:blue")
    ax2.set_ylabel("sync ms (verified)")
    ax2.set_xlabel("RL step")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_json(result: DemoResult, path: Path) -> Path:
    path.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return path
