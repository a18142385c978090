"""Per-expert checkpoint names grouped into the fused expert tensors they make. Pure: names
and patterns in, records out.

A trainer that holds its Mixture-of-Experts experts one by one names them as checkpoints do
(`model.layers.0.mlp.experts.3.gate_proj.weight`); an engine that loads them fused
(`weightsync serve`, transformers 5) takes `mlp.experts.gate_up_proj` `[E, 2I, H]` and
`down_proj` `[E, H, I]`. Which names make which fused tensor is given by patterns
(transformers' conversion mapping of the model, read by `naming.expert_converters`), never
guessed from the names; a set that is not complete is refused naming what is missing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from weightsync.errors import NamingError, format_names


@dataclass(frozen=True)
class ExpertStack:
    """One fused checkpoint tensor made of per-expert tensors held one by one (the reverse
    of `naming.ExpertSlice`): `[num_experts, num_parts x rows, cols]`, expert e part k being
    `parts[e * num_parts + k]`, in the fused tensor's memory order (e0 gate, e0 up, e1 gate...)."""

    hf_name: str
    """The fused tensor's checkpoint name, e.g. "model.layers.0.mlp.experts.gate_up_proj"."""
    parts: tuple[str, ...]
    """The per-expert checkpoint names it is stacked from, in memory order."""
    num_experts: int
    num_parts: int
    """Tensors per expert concatenated on dim 1 (gate and up: 2; down: 1)."""


def stack_expert_names(hf_names: Iterable[str], converters: Iterable[tuple[str, Sequence[str]]], *,
                       prefix: str = "") -> tuple[ExpertStack, ...]:
    """Group per-expert checkpoint names into the fused tensors they make, by `converters`
    ((fused target, per-expert source patterns with one "*" for the expert), as
    `expert_converters` reads them). Names under `prefix` (the transformers model's own, in
    the checkpoint) that match no pattern are left out; a matched set must be complete: every
    expert from 0 to the highest present, each with every pattern, or NamingError lists the
    missing names. Stacks come in the order their first part is met."""
    rules = [(target, [re.compile(r"(?:(?P<stem>.*)\.)?" + re.escape(pattern).replace(r"\*", r"(?P<expert>\d+)"))
                       for pattern in patterns], tuple(patterns))
             for target, patterns in converters]
    found: dict[str, tuple[tuple[str, ...], str, dict[tuple[int, int], str]]] = {}
    """fused name -> (its patterns, its stem, (expert, part) -> per-expert name)."""
    for hf_name in hf_names:
        if not hf_name.startswith(prefix):
            continue
        relative = hf_name[len(prefix):]
        for target, regexes, patterns in rules:
            for part, regex in enumerate(regexes):
                match = regex.fullmatch(relative)
                if match is None or str(int(match["expert"])) != match["expert"]:
                    continue
                stem = prefix + (match["stem"] + "." if match["stem"] is not None else "")
                entry = found.setdefault(stem + target, (patterns, stem, {}))
                entry[2][(int(match["expert"]), part)] = hf_name
    stacks, missing = [], []
    for fused_name, (patterns, stem, parts) in found.items():
        num_experts = 1 + max(e for e, _ in parts)
        absent = [stem + pattern.replace("*", str(e)) for e in range(num_experts)
                  for k, pattern in enumerate(patterns) if (e, k) not in parts]
        if absent:
            missing.append(f"{fused_name} lacks {format_names(absent)}")
            continue
        stacks.append(ExpertStack(hf_name=fused_name, num_experts=num_experts, num_parts=len(patterns),
                                  parts=tuple(parts[(e, k)] for e in range(num_experts) for k in range(len(patterns)))))
    if missing:
        raise NamingError(
            "per-expert tensors do not make whole fused expert tensors (every expert from 0 to the last, each "
            f"with every projection, is stacked into one): {'; '.join(missing)}; send every expert's tensors, or "
            "push to an engine that loads experts one by one (expert_layout='per-expert')")
    return tuple(stacks)
