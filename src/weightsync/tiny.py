"""Tiny causal LMs for tests, the demo and benchmarks, built offline.

`make_tiny_model` writes a Hugging Face model directory (config, safetensors
weights, a byte-level BPE tokenizer trained here from a built-in corpus) that
`AutoModelForCausalLM`, `AutoTokenizer`, vLLM and the embedded engine load
with no download. head_dim is fixed at 64: vLLM's CPU attention kernels refuse
smaller heads.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

HEAD_DIM = 64
SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>")

# A small English corpus: enough for the BPE trainer to learn a few hundred merges.
_CORPUS = """
the quick brown fox jumps over the lazy dog. a policy is trained with rewards from rollouts.
weights move from the trainer to the inference engine after every step of reinforcement learning.
every update is verified: digests on both sides, an acknowledgement of the version and the names.
one two three four five six seven eight nine ten. red green blue yellow orange purple black white.
the engine generates tokens, the trainer computes advantages, and the sync layer keeps them equal.
apples and oranges, cats and dogs, rivers and mountains, questions and answers, inputs and outputs.
hello world. good morning. thank you very much. see you later. how are you today? fine, thanks.
numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 512 1024 2048 4096.
"""


@dataclass(frozen=True, kw_only=True)
class TinyModelConfig:
    """Shape of a tiny model; defaults make a ~1 MB float32 model."""

    arch: str = "qwen2"
    """"qwen2", "llama", or a Mixture-of-Experts model: "qwen3_moe" (every layer MoE),
    "mixtral" (every layer MoE; its checkpoint names the block `block_sparse_moe` and the
    experts' projections `w1` / `w3` / `w2`, which transformers renames on load), "glm4_moe"
    (layer 0 dense, the others MoE with a shared expert and a router bias buffer,
    `e_score_correction_bias`, as GLM-4.5 holds it) or "deepseek_v3" (the same MoE layout as
    "glm4_moe", with multi-head latent attention: `q_a_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`)."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 2
    """Attention heads; hidden size is num_heads * 64."""
    num_kv_heads: int = 1
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = 256
    """MLP width."""
    num_experts: int = 8
    """MoE archs: routed experts per MoE layer."""
    moe_intermediate_size: int = 64
    """MoE archs: each expert's MLP width."""
    vocab_size: int = 512
    """Vocabulary (the tokenizer is trained to exactly this size)."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the LM head."""
    dtype: str = "float32"
    """Weight dtype, a torch attribute name."""
    max_position_embeddings: int = 1024
    """Longest sequence."""
    seed: int = 0
    """Initialisation seed."""

    @property
    def hidden_size(self) -> int:
        return self.num_heads * HEAD_DIM


def _hf_config(cfg: TinyModelConfig) -> Any:
    common: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
        rms_norm_eps=1e-6,
    )
    if cfg.arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common)
    if cfg.arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common, head_dim=HEAD_DIM)
    moe: dict[str, Any] = dict(moe_intermediate_size=cfg.moe_intermediate_size, num_experts_per_tok=2,
                               head_dim=HEAD_DIM)
    if cfg.arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**common, **moe, num_experts=cfg.num_experts, decoder_sparse_step=1, mlp_only_layers=[])
    if cfg.arch == "mixtral":
        from transformers import MixtralConfig

        # Mixtral's experts are `intermediate_size` wide (it has no dense MLP): the MoE width here.
        return MixtralConfig(**{**common, "intermediate_size": cfg.moe_intermediate_size},
                             num_local_experts=cfg.num_experts, num_experts_per_tok=2, head_dim=HEAD_DIM)
    if cfg.arch == "glm4_moe":
        from transformers import Glm4MoeConfig

        return Glm4MoeConfig(**common, **moe, n_routed_experts=cfg.num_experts, n_shared_experts=1,
                             first_k_dense_replace=1, n_group=1, topk_group=1, use_qk_norm=False)
    if cfg.arch == "deepseek_v3":
        from transformers import DeepseekV3Config

        # vLLM's CPU MLA kernels take only DeepSeek-V3's own latent width: kv_lora_rank 512 +
        # qk_rope_head_dim 64 (`CPUMLABackend.get_supported_head_sizes() == [576]`). transformers
        # always routes DeepSeek-V3 by sigmoid scores and the correction bias, but its config writes
        # neither `topk_method` nor `scoring_func`, which vLLM reads (DeepSeek's own config.json has
        # both): without them vLLM builds no `e_score_correction_bias` and refuses the checkpoint's.
        # MLA gives every head its own key and value (num_key_value_heads = heads: fewer would be
        # repeated into too many).
        vllm_routing: dict[str, Any] = dict(topk_method="noaux_tc", scoring_func="sigmoid")
        return DeepseekV3Config(**{**common, "num_key_value_heads": cfg.num_heads},
                                moe_intermediate_size=cfg.moe_intermediate_size, n_routed_experts=cfg.num_experts,
                                n_shared_experts=1, num_experts_per_tok=2,
                                first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=64,
                                kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=HEAD_DIM,
                                v_head_dim=HEAD_DIM, **vllm_routing)
    raise ValueError(f"unknown arch {cfg.arch!r}; use 'qwen2', 'llama', 'qwen3_moe', 'mixtral', 'glm4_moe' "
                     "or 'deepseek_v3'")


def build_model(cfg: TinyModelConfig) -> Any:
    """A randomly initialised model (not saved), seeded for reproducibility."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(_hf_config(cfg))
    # Default init leaves biases at zero and norms at one; nudge them so that
    # every tensor carries information a broken sync would lose.
    with torch.no_grad():
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
        persistent = set(model.state_dict())
        for name, b in model.named_buffers():  # router biases (glm4_moe, deepseek_v3): zeros at init
            if name in persistent and b.is_floating_point():
                b.add_(torch.randn(b.shape, generator=gen) * 0.02)
    return model.to(getattr(torch, cfg.dtype)).eval()


def build_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer of exactly `vocab_size` tokens, trained offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    # Pad the vocabulary to exactly vocab_size so ids and embedding rows agree.
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<|extra_{i}|>" for i in range(missing)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS[0],
        eos_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[1],
    )


def make_tiny_model(out_dir: str | Path, cfg: TinyModelConfig | None = None) -> Path:
    """Write a tiny model directory (config, weights, tokenizer) and return its path."""
    cfg = cfg or TinyModelConfig()
    if cfg.vocab_size < 300:
        raise ValueError(f"vocab_size must be at least 300 (256 bytes + specials + merges), got {cfg.vocab_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(cfg)
    model.save_pretrained(out)
    tokenizer = build_tokenizer(cfg.vocab_size)
    tokenizer.save_pretrained(out)
    (out / "weightsync_tiny.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    return out
