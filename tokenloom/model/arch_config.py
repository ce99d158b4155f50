"""The architecture hyper-parameters every model file needs, read from a HF config or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class UnsupportedModelError(ValueError):
    """The model's architecture, quantization or layout is not supported."""


# GGUF general.architecture -> HF architectures name.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Tokens each position attends back over, when the model limits it (Mistral's sliding_window); None: all.
    sliding_window: int | None = None
    # Encoders (BERT): LayerNorm epsilon and the token-type vocabulary.
    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 2

    def check_tensor_parallel(self, size: int) -> None:
        """Raise a one-line ConfigError naming the numbers when `size` ranks cannot share this model."""
        from tokenloom.config import ConfigError
        problems = []
        if self.num_heads % size:
            problems.append(f"its {self.num_heads} attention heads")
        if self.num_kv_heads % size and size % self.num_kv_heads:
            problems.append(f"its {self.num_kv_heads} KV heads (nor is it a multiple of them)")
        if self.intermediate_size % size:
            problems.append(f"its MLP width {self.intermediate_size}")
        if problems:
            raise ConfigError(f"tensor_parallel_size {size} does not divide {' or '.join(problems)}")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ArchConfig":
        archs = cfg.get("architectures") or []
        if not archs:
            raise UnsupportedModelError("config.json names no 'architectures'")
        arch = archs[0]
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            sliding_window=_sliding_window(cfg),
            layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
            type_vocab_size=cfg.get("type_vocab_size", 2),
        )

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], tensor_names: set[str]) -> "ArchConfig":
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r} "
                                        f"(supported: {', '.join(GGUF_ARCHITECTURES)})")

        def get(key, default=None):
            return meta.get(f"{arch}.{key}", default)

        heads = get("attention.head_count")
        hidden = get("embedding_length")
        head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // heads
        scaling = None
        if get("rope.scaling.type") in ("linear",) and get("rope.scaling.factor"):
            scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=GGUF_ARCHITECTURES[arch],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length"),
            num_layers=get("block_count"),
            num_heads=heads,
            num_kv_heads=get("attention.head_count_kv") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=get("context_length", 2048),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[eos] if eos is not None else [],
            sliding_window=get("attention.sliding_window"),
        )


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    """The window the model attends over, if it uses one (Qwen2 configs name one they switch off)."""
    if cfg.get("use_sliding_window") is False:
        return None
    return cfg.get("sliding_window") or None


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    return dict(scaling, rope_type=kind)
