"""The architecture hyper-parameters every model file needs, read from a HF config or GGUF metadata."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from tokenloom.config import ConfigError
from tokenloom.core.json_types import JsonObject
from tokenloom.model.model_errors import CorruptModelError, ModelFileError, UnsupportedModelError

# GGUF general.architecture -> HF architectures name.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    # Qwen2.5-VL's text model (its M-RoPE sections read only with an mmproj: alone, every stream is the same
    # position, which is the plain rotary).
    "qwen2vl": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    # Mixture of experts (a "llama" file with experts is Mixtral: see from_gguf).
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# Vision-language models: their text model is one of these (config.json's text_config.model_type).
MULTIMODAL_ARCHITECTURES = ("LlavaForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                            "Gemma3ForConditionalGeneration")
MULTIMODAL_TEXT_MODELS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                          "qwen2_5_vl_text": "Qwen2ForCausalLM", "qwen2_5_vl": "Qwen2ForCausalLM",
                          "gemma3_text": "Gemma3ForCausalLM"}
# transformers' Gemma3TextConfig defaults (Gemma 3 4B's text model), for a text_config that states only what
# differs (the released Gemma 3 4B/12B/27B config.json files do).
GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                        "head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
                        "sliding_window": 4096, "query_pre_attn_scalar": 256}
# transformers' LlamaConfig defaults (Llama 2 7B), for a text_config that states only what differs.
LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048}
# The sizes every HF config.json states (decoders and BERT alike); the rest have defaults.
HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# The GGUF metadata (`<arch>.<key>`) every file states; llama.cpp refuses a file without them too.
GGUF_REQUIRED = ("block_count", "embedding_length", "attention.head_count")
# Families whose router renormalizes its top-k weights when the file does not say (llama.cpp's defaults).
_GGUF_MOE_RENORMALIZES = {"llama": True, "qwen2moe": False, "qwen3moe": True}


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
    rope_scaling: JsonObject | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Tokens each position attends back over, itself included (HF's sliding_window); None: all. Which layers
    # do: layer_types ("sliding_attention" | "full_attention" per layer), or every layer when it is None.
    sliding_window: int | None = None
    # Encoders (BERT): LayerNorm epsilon and the token-type vocabulary.
    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 2
    layer_types: list[str] | None = None
    # Gemma 3: the windowed layers' rotary base, the query scale's denominator (scores * scalar**-0.5),
    # tanh soft-capping of the final logits, the gated MLP's activation.
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    hidden_activation: str = "silu"
    # Mixture of experts (0 experts: a dense model). Layers listed in mlp_only_layers, or not a multiple of
    # decoder_sparse_step, keep the dense MLP of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalize the top-k router weights to sum to 1
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # A vision-language model's whole config.json (its text model's fields are the ones above).
    multimodal_config: JsonObject | None = None

    def layer_window(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends within; None: the whole context (a window as long as
        the context is none)."""
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        if self.sliding_window is None or self.sliding_window >= self.max_position_embeddings:
            return None
        return self.sliding_window

    @property
    def all_layers_windowed(self) -> bool:
        """Every layer attends within the window, so KV blocks behind it can be freed."""
        return all(self.layer_window(i) is not None for i in range(self.num_layers))

    def is_sparse_layer(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def check_tensor_parallel(self, size: int, expert_parallel: bool = False, redundant_experts: int = 0) -> None:
        """Raise a one-line ConfigError naming the numbers when `size` ranks cannot share this model."""
        problems = []
        if self.num_heads % size:
            problems.append(f"its {self.num_heads} attention heads")
        if self.num_kv_heads % size and size % self.num_kv_heads:
            problems.append(f"its {self.num_kv_heads} KV heads (nor is it a multiple of them)")
        if self.intermediate_size % size:
            problems.append(f"its MLP width {self.intermediate_size}")
        if self.num_experts and not expert_parallel and self.moe_intermediate_size % size:
            problems.append(f"its expert width {self.moe_intermediate_size} (--enable-expert-parallel shards "
                            f"whole experts instead)")
        if problems:
            raise ConfigError(f"tensor_parallel_size {size} does not divide {' or '.join(problems)}")
        if expert_parallel:
            self.check_expert_parallel(size, redundant_experts)

    def check_expert_parallel(self, size: int, redundant_experts: int = 0) -> None:
        """`redundant_experts`: the load balancer's extra copies (tokenloom.distributed.eplb), shared out evenly;
        a rank holds at most one copy of each expert, so it cannot have more slots than the model has experts."""
        if not self.num_experts:
            raise ConfigError(f"enable_expert_parallel needs a mixture-of-experts model ({self.architecture} "
                              f"has no experts)")
        if self.num_experts % size:
            raise ConfigError(f"expert parallel over {size} ranks does not divide the model's {self.num_experts} "
                              f"experts")
        if redundant_experts % size:
            raise ConfigError(f"num_redundant_experts {redundant_experts} does not divide over {size} expert-parallel "
                              f"ranks")
        per_rank = (self.num_experts + redundant_experts) // size
        if per_rank > self.num_experts:
            raise ConfigError(f"num_redundant_experts {redundant_experts} gives each of {size} ranks {per_rank} "
                              f"expert slots, more than the model's {self.num_experts} experts (at most "
                              f"{self.num_experts * (size - 1)})")

    @classmethod
    def from_hf(cls, cfg: JsonObject) -> "ArchConfig":
        """From a config.json; a missing or ill-typed size is a CorruptModelError naming the key."""
        arch = hf_architecture(cfg)
        if arch in MULTIMODAL_ARCHITECTURES:
            return replace(cls.from_hf(_text_config(cfg, arch)), architecture=arch, multimodal_config=dict(cfg))
        missing = [key for key in HF_REQUIRED if key not in cfg]
        if missing:
            raise CorruptModelError(f"config.json lacks {', '.join(map(repr, missing))} (needed by {arch})")
        try:
            return cls._from_hf(cfg, arch)
        except ModelFileError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptModelError(f"config.json: {type(exc).__name__} {exc} (a size missing or of the wrong "
                                    f"type)") from None

    @classmethod
    def _from_hf(cls, cfg: JsonObject, arch: str) -> "ArchConfig":
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        return replace(cls(
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
            attention_bias=cfg.get("attention_bias", arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            sliding_window=_sliding_window(cfg),
            layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
            type_vocab_size=cfg.get("type_vocab_size", 2),
            layer_types=cfg.get("layer_types"),
            **_hf_moe(cfg, arch),
        ), **_hf_gemma3(cfg, arch))

    @classmethod
    def from_gguf(cls, meta: Mapping[str, object], tensor_names: set[str]) -> "ArchConfig":
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r} "
                                        f"(supported: {', '.join(GGUF_ARCHITECTURES)})")

        def get(key, default=None):
            return meta.get(f"{arch}.{key}", default)

        missing = [f"{arch}.{key}" for key in GGUF_REQUIRED if get(key) is None]
        if missing:
            raise CorruptModelError(f"GGUF metadata lacks {', '.join(missing)}")
        try:
            return cls._from_gguf(meta, tensor_names, arch, get)
        except ModelFileError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:
            raise CorruptModelError(f"GGUF metadata of {arch!r}: {type(exc).__name__} {exc}") from None

    @classmethod
    def _from_gguf(cls, meta: Mapping[str, object], tensor_names: set[str], arch: str, get) -> "ArchConfig":
        heads = get("attention.head_count")
        hidden = get("embedding_length")
        head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // heads
        scaling = None
        if get("rope.scaling.type") in ("linear",) and get("rope.scaling.factor"):
            scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture="MixtralForCausalLM" if arch == "llama" and get("expert_count") else GGUF_ARCHITECTURES[arch],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length") or get("expert_feed_forward_length"),
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
            **_gguf_gemma3(arch, get),
            **_gguf_moe(arch, get, tensor_names),
        )


def hf_architecture(cfg: JsonObject) -> str:
    """The architecture a config.json names (its first `architectures` entry)."""
    archs = cfg.get("architectures")
    if not archs or not isinstance(archs, list) or not isinstance(archs[0], str):
        raise UnsupportedModelError("config.json names no 'architectures' (a transformers model folder lists "
                                    "its class there, e.g. [\"LlamaForCausalLM\"])")
    return archs[0]


def _text_config(cfg: JsonObject, arch: str) -> JsonObject:
    """A vision-language config's text model as a config.json of its own. A LLaVA config.json often states
    only the fields its text model changes from LlamaConfig's defaults (llava-1.5-7b-hf: vocab size,
    context, norm eps), so those defaults fill the rest."""
    if arch == "Qwen2_5_VLForConditionalGeneration":
        return _qwen2_5_vl_text_config(cfg)
    text = cfg.get("text_config") or {}
    kind = text.get("model_type", "llama")
    if kind not in MULTIMODAL_TEXT_MODELS:
        raise UnsupportedModelError(f"{arch} with a {kind!r} text model is not supported (supported: "
                                    f"{', '.join(MULTIMODAL_TEXT_MODELS)})")
    defaults = GEMMA3_TEXT_DEFAULTS if kind == "gemma3_text" else LLAMA_DEFAULTS
    merged = {**defaults, **text, "architectures": [MULTIMODAL_TEXT_MODELS[kind]]}
    if "tie_word_embeddings" in cfg:
        merged["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return merged


def _qwen2_5_vl_text_config(cfg: JsonObject) -> JsonObject:
    """Qwen2.5-VL's text model as a Qwen2 config.json. The released files state its fields at the top level,
    a transformers 5 save under text_config. Its rotary is M-RoPE (`rope_scaling` type "mrope", or
    transformers 5's `mrope_section` in rope_parameters): the model reads the sections from the whole config,
    and the plain rotary it falls back to for text positions has no scaling."""
    text = cfg.get("text_config") or cfg
    merged = {key: value for key, value in text.items() if key not in ("rope_scaling", "rope_parameters")}
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    merged["rope_theta"] = text.get("rope_theta", rope.get("rope_theta", 1000000.0))
    merged["architectures"] = ["Qwen2ForCausalLM"]
    if "tie_word_embeddings" in cfg:
        merged["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return merged


def mrope_section(cfg: JsonObject) -> list[int]:
    """The rotary frequency pairs each position stream (time, row, column) turns, from a Qwen2.5-VL
    config.json (released: top-level `rope_scaling`; transformers 5: text_config's `rope_parameters`)."""
    text = cfg.get("text_config") or cfg
    rope = text.get("rope_parameters") or text.get("rope_scaling") or cfg.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    if not isinstance(section, list) or len(section) != 3 or not all(isinstance(v, int) for v in section):
        raise CorruptModelError(f"config.json: Qwen2.5-VL's rope mrope_section must be three integers (got "
                                f"{section!r})")
    return section


def _hf_moe(cfg: JsonObject, arch: str) -> JsonObject:
    """The mixture-of-experts fields of a HF config (Mixtral: num_local_experts, experts as wide as the MLP)."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    if not experts:
        return {}
    return dict(num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
                norm_topk_prob=arch == "MixtralForCausalLM" or bool(cfg.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
                decoder_sparse_step=cfg.get("decoder_sparse_step") or 1,
                mlp_only_layers=list(cfg.get("mlp_only_layers") or []))


def _gguf_moe(arch: str, get, tensor_names: set[str]) -> JsonObject:
    """The mixture-of-experts fields of GGUF metadata (llama.cpp keys `<arch>.expert_*`); a layer without a
    router tensor keeps a dense MLP."""
    experts = get("expert_count") or 0
    if not experts:
        return {}
    dense = [i for i in range(get("block_count")) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
    return dict(num_experts=experts, num_experts_per_tok=get("expert_used_count"),
                moe_intermediate_size=get("expert_feed_forward_length") or get("feed_forward_length"),
                norm_topk_prob=bool(get("expert_weights_norm", _GGUF_MOE_RENORMALIZES.get(arch, True))),
                shared_expert_intermediate_size=get("expert_shared_feed_forward_length") or 0,
                mlp_only_layers=dense)


def _hf_gemma3(cfg: JsonObject, arch: str) -> JsonObject:
    """Gemma 3's fields of a HF config: per-layer attention kinds and rotary bases (transformers 5 nests the
    bases in rope_parameters by layer kind; 4.x names them rope_theta and rope_local_base_freq)."""
    if arch != "Gemma3ForCausalLM":
        return {}
    if cfg.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError("attention logit soft-capping (attn_logit_softcapping) is not supported")
    layers = cfg["num_hidden_layers"]
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
    kinds = cfg.get("layer_types") or [_gemma3_kind(i, pattern) for i in range(layers)]
    params = cfg.get("rope_parameters") or {}
    full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    scaling = cfg.get("rope_scaling") or (full if full.get("rope_type", "default") != "default" else None)
    return dict(layer_types=list(kinds), qk_norm=True, tie_word_embeddings=cfg.get("tie_word_embeddings", True),
                head_dim=cfg.get("head_dim", 256), rope_theta=float(full.get("rope_theta", cfg.get("rope_theta", 1e6))),
                rope_local_theta=float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))),
                rope_scaling=_rope_scaling({"rope_scaling": scaling}) if scaling else None,
                query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
                final_logit_softcapping=cfg.get("final_logit_softcapping"),
                hidden_activation=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh")


def _gguf_gemma3(arch: str, get) -> JsonObject:
    """Gemma 3's fields of GGUF metadata. The file names the global rotary base and the window only; the
    rest are Gemma 3's defaults as llama.cpp applies them: every 6th layer global, local base 10000, no
    soft-capping, GeLU(tanh), queries scaled by head_dim**-0.5, except the 62-layer 27B, whose config scales
    by (hidden / heads)**-0.5 (transformers assumes 256 for every file: the same but for the 27B)."""
    if arch != "gemma3":
        return {}
    layers = get("block_count")
    pattern = get("attention.sliding_window_pattern") or 6
    scalar = get("embedding_length") / get("attention.head_count") if layers == 62 else get("attention.key_length")
    return dict(layer_types=[_gemma3_kind(i, pattern) for i in range(layers)], rope_local_theta=10000.0,
                query_pre_attn_scalar=float(scalar or 256),
                final_logit_softcapping=get("final_logit_softcapping"), hidden_activation="gelu_pytorch_tanh")


def _gemma3_kind(layer: int, pattern: int) -> str:
    return "full_attention" if (layer + 1) % pattern == 0 else "sliding_attention"


def _sliding_window(cfg: JsonObject) -> int | None:
    """The window the model attends over, if it uses one (Qwen2 configs name one they switch off)."""
    if cfg.get("use_sliding_window") is False:
        return None
    return cfg.get("sliding_window") or None


def _rope_scaling(cfg: JsonObject) -> JsonObject | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    return dict(scaling, rope_type=kind)
