"""The toy RL algorithm of the demo: group-relative advantages and a
policy-gradient step. Pure: tensors in, tensors out.

The task is deliberately simple and verifiable: the reward of a rollout is the
fraction of its generated tokens that belong to a fixed target set, so a policy
that learns shows a rising reward within a few dozen steps on a tiny model.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from torch import nn


def target_reward(output_ids: Sequence[int], target: Collection[int]) -> float:
    """Fraction of generated tokens that are in `target`."""
    if not output_ids:
        return 0.0
    return sum(t in target for t in output_ids) / len(output_ids)


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """GRPO: each reward minus its group's mean, over the group's std (+eps)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.view(-1, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    return (centered / (groups.std(dim=1, keepdim=True) + 1e-4)).view(-1)


def token_logprobs(
    model: nn.Module, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]
) -> torch.Tensor:
    """Teacher-forced logprobs of every output token, [batch, output_len].

    All prompts share one length and all outputs another (the demo asks for
    fixed lengths), so the batch needs no padding.
    """
    prompt_len = len(prompts[0])
    ids = torch.tensor([list(p) + list(o) for p, o in zip(prompts, outputs, strict=True)])
    logits = model(input_ids=ids).logits[:, prompt_len - 1 : -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(2, ids[:, prompt_len:].unsqueeze(2)).squeeze(2)


def policy_loss(logprobs: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """REINFORCE with group-relative advantages, averaged over tokens."""
    return -(logprobs * advantages.unsqueeze(1)).mean()
