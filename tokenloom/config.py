"""Engine configuration: typed dataclasses with validation, plus their CLI flags.

Every option is also settable through an environment variable
``TOKENLOOM_<NAME>`` (e.g. ``TOKENLOOM_MAX_NUM_SEQS=64``); a flag wins over it.
"""
from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

from tokenloom.core.sampling_params import LOGPROBS_MODES
from tokenloom.env_vars import is_true
from tokenloom.structured.reasoning import REASONING_PARSERS
from tokenloom.structured.tool_parsers import TOOL_PARSERS

EMBEDDED_MODEL = "smollm2-135m-instruct"


class ConfigError(ValueError):
    """A configuration value a user set is out of range or inconsistent."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def parse_json_config(cls, value, name: str, check_first: Callable[[dict], None] | None = None):
    """A typed config from a dict, a JSON string (the CLI flag --NAME), an instance of `cls` or None; unknown
    keys are one-line errors naming the known ones. `check_first` sees the dict before the keys are checked
    (a value that makes the other keys moot, such as an unsupported method, is the error to report)."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--{name.replace('_', '-')} is not valid JSON: {e}") from None
    _check(isinstance(value, dict), f"{name} must be a JSON object (got {type(value).__name__})")
    if check_first is not None:
        check_first(value)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    _check(not unknown, f"unknown {name} key(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return cls(**value)



# Other spellings of the dtypes, as vLLM (half, float), PyTorch and llama.cpp (fp16, bf16, f32) write them.
DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "f16": "float16", "float": "float32", "fp32": "float32",
                 "f32": "float32", "bf16": "bfloat16"}


def normalize_dtype(value: str) -> str:
    return DTYPE_ALIASES.get(value.lower(), value.lower()) if isinstance(value, str) else value


# vLLM's names for its 8-bit KV cache; tokenloom's is int8 with a scale per token and head (kv_int8.py).
KV_CACHE_DTYPE_ALIASES = {"fp8": "int8", "fp8_e4m3": "int8"}


def _check_dtype(name: str, value: str) -> None:
    _check(value in ("auto", "float32", "bfloat16", "float16"),
           f"{name} must be one of auto, float32, bfloat16, float16 (or half, float, fp16, bf16, fp32; "
           f"got {value!r})")


@dataclass
class ModelConfig:
    model: str = EMBEDDED_MODEL
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    matmul_dtype: str = "auto"  # auto (= dtype) | float32 | bfloat16 | float16: linear-layer weights and inputs
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_model_len: int | None = None  # None: the model's context, clamped to the KV cache
    served_model_name: str | None = None
    seed: int = 0
    quantized_matmul: str = "exact"  # exact | w4a8: how quantized GGUF weights multiply (tokenloom/kernels)
    # tokenloom.model.layers.attention_backend: auto | torch | native (CPU kernels) | flashinfer (CUDA)
    attention_backend: str = "auto"
    enforce_eager: bool = False  # no CUDA graphs, no native decoder stack (model/cuda_graphs.py, native_stack.py)
    cuda_graph_sizes: list[int] | None = None  # CUDA: decode batch sizes to capture; None: 1, 2, 4, 8, 16, ...
    # vLLM's --runner / --convert: "pooling" (or convert "embed") serves embeddings instead of generation;
    # auto: pooling for an encoder (BERT), generate otherwise. See tokenloom/model/pooler.py.
    runner: str = "auto"  # auto | generate | pooling
    convert: str = "auto"  # auto | none | embed
    # What logprobs report for requests that do not choose (tokenloom.core.sampling_params.LOGPROBS_MODES).
    logprobs_mode: str = "raw_logprobs"
    # vLLM's --logits-processors: module:Class names of tokenloom.LogitsProcessor subclasses, applied in order.
    logits_processors: list[str] | None = None
    # llama.cpp's --mmproj: the GGUF holding a vision-language model's tower and projector, beside a GGUF text
    # model (docs/multimodal.md#gguf-models-with-an-mmproj-file).
    mmproj: str | None = None

    def __post_init__(self) -> None:
        self.dtype = normalize_dtype(self.dtype)
        if self.mmproj is not None:
            _check(os.path.isfile(self.mmproj), f"--mmproj {self.mmproj}: no such file")
            _check(not os.path.isdir(self.model), f"--mmproj goes with a GGUF model file; {self.model} is a model "
                   f"folder, which brings its own vision tower (serve it without --mmproj)")
        self.matmul_dtype = normalize_dtype(self.matmul_dtype)
        _check_dtype("dtype", self.dtype)
        _check_dtype("matmul_dtype", self.matmul_dtype)
        _check(self.quantized_matmul in ("exact", "w4a8"),
               f"quantized_matmul must be exact or w4a8 (got {self.quantized_matmul!r})")
        _check(self.max_model_len is None or self.max_model_len >= 1,
               f"max_model_len must be >= 1 (got {self.max_model_len})")
        _check(not self.cuda_graph_sizes or min(self.cuda_graph_sizes) >= 1,
               f"cuda_graph_sizes must be positive batch sizes (got {self.cuda_graph_sizes})")
        _check(self.runner in ("auto", "generate", "pooling"),
               f"runner must be auto, generate or pooling (got {self.runner!r})")
        _check(self.convert in ("auto", "none", "embed"), f"convert must be auto, none or embed (got {self.convert!r})")
        _check(not (self.runner == "generate" and self.convert == "embed"),
               "--convert embed makes a pooling model: it cannot go with --runner generate")
        _check(self.logprobs_mode in LOGPROBS_MODES,
               f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)} (got {self.logprobs_mode!r})")


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: float = 2.0  # GiB, CPU
    gpu_memory_utilization: float = 0.9  # CUDA
    num_blocks: int | None = None  # overrides the memory budget
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # auto (= the model dtype) | float32 | bfloat16 | float16 | int8 (fp8, fp8_e4m3)

    def __post_init__(self) -> None:
        self.kv_cache_dtype = normalize_dtype(self.kv_cache_dtype)
        self.kv_cache_dtype = KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        _check(self.kv_cache_dtype != "fp8_e5m2",
               "kv_cache_dtype fp8_e5m2 is not supported: fp8 (= fp8_e4m3 = int8) stores 8-bit values with a "
               "scale per token and head")
        if self.kv_cache_dtype != "int8":
            _check_dtype("kv_cache_dtype", self.kv_cache_dtype)
        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256),
               f"block_size must be a power of two in 1..256 (got {self.block_size})")
        _check(self.kv_cache_memory > 0, f"kv_cache_memory must be > 0 GiB (got {self.kv_cache_memory})")
        _check(0 < self.gpu_memory_utilization <= 1,
               f"gpu_memory_utilization must be in (0, 1] (got {self.gpu_memory_utilization})")
        _check(self.num_blocks is None or self.num_blocks >= 2,
               f"num_blocks must be >= 2 (got {self.num_blocks})")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    # 512 by measurement on CPU: a step's activations stay in the CPU cache (prefill 964 -> 1,032 tokens/s
    # against 1024; see docs/performance.md).
    max_num_batched_tokens: int = 512
    long_prefill_token_threshold: int = 512  # per-request cap on one prefill chunk
    # Schedule step N+1 while step N runs and apply N's outputs after N+1 is launched (tokenloom/engine/core.py);
    # FastDeploy's enable_overlap_schedule.
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1 (got {self.max_num_seqs})")
        _check(self.max_num_batched_tokens >= 1,
               f"max_num_batched_tokens must be >= 1 (got {self.max_num_batched_tokens})")
        _check(self.long_prefill_token_threshold >= 1,
               f"long_prefill_token_threshold must be >= 1 (got {self.long_prefill_token_threshold})")


@dataclass
class LoRAConfig:
    """LoRA adapters (tokenloom/lora, docs/lora.md): vLLM's flags and defaults."""

    enable_lora: bool = False
    max_loras: int = 1  # adapters resident in the workers' slots at once (and so in one step)
    max_lora_rank: int = 16  # the slots' rank; an adapter of a higher rank is refused
    max_cpu_loras: int | None = None  # adapters kept read in host memory (None: max_loras)
    # The slots' dtype: auto (= the model dtype) | float32 | bfloat16 | float16. The adapters' weights are what a
    # step with adapter rows reads beyond the base model's: a rank-16 adapter on all seven targets of the
    # embedded SmolLM2 is 19.6 MB in float32, a third of its Q4_1 decoder weights; 16 bits halve that.
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        self.lora_dtype = normalize_dtype(self.lora_dtype)
        _check_dtype("lora_dtype", self.lora_dtype)
        _check(self.max_loras >= 1, f"max_loras must be >= 1 (got {self.max_loras})")
        _check(1 <= self.max_lora_rank <= 512, f"max_lora_rank must be in 1..512 (got {self.max_lora_rank})")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        _check(self.max_cpu_loras >= self.max_loras,
               f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    @property
    def num_slots(self) -> int:
        """The scheduler's and workers' slot count: 0 when LoRA is off."""
        return self.max_loras if self.enable_lora else 0


def _torchrun_env(name: str, default, kind=str):
    """A rendezvous value from torchrun's environment (MASTER_ADDR, MASTER_PORT, NODE_RANK, NNODES)."""
    raw = os.environ.get(name)
    return default if raw in (None, "") else kind(raw)


EXECUTOR_BACKENDS = ("uni", "mp")
DEFAULT_MASTER_PORT = 29500  # torch.distributed's own default


@dataclass
class EPLBConfig:
    """vLLM's --eplb-config: every `step_interval` steps the experts are re-placed over the expert-parallel
    ranks from the tokens routed to each in the last `window_size` steps, with `num_redundant_experts` extra
    copies of the busiest (tokenloom.distributed.eplb). FastDeploy's eplb_config spells the replica count
    `redundant_experts_num` and may carry `enable_eplb`."""

    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int = 0
    log_balancedness: bool = False  # log each re-placement's load figures at INFO (else DEBUG)
    enable_eplb: bool | None = None  # FastDeploy's switch inside its eplb_config

    def __post_init__(self) -> None:
        for name in ("window_size", "step_interval"):
            value = getattr(self, name)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                   f"eplb_config {name} must be an int >= 1 (got {value!r})")
        _check(isinstance(self.num_redundant_experts, int) and self.num_redundant_experts >= 0,
               f"eplb_config num_redundant_experts must be an int >= 0 (got {self.num_redundant_experts!r})")

    @classmethod
    def parse(cls, value) -> "EPLBConfig | None":
        """From a dict, a JSON string (the CLI flag), an instance or None; FastDeploy's key renamed."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--eplb-config is not valid JSON: {e}") from None
        if isinstance(value, dict) and "redundant_experts_num" in value:
            _check("num_redundant_experts" not in value,
                   "eplb_config has both num_redundant_experts and FastDeploy's redundant_experts_num")
            value = {**value}
            value["num_redundant_experts"] = value.pop("redundant_experts_num")
        return parse_json_config(cls, value, "eplb_config")


@dataclass
class ParallelConfig:
    """How many ranks share the model, and how they are started (vLLM's flag names)."""

    tensor_parallel_size: int = 1
    # uni: the worker runs in the EngineCore's process (size 1 only); mp: one process per rank.
    # None: uni at size 1, mp above.
    distributed_executor_backend: str | None = None
    nnodes: int = field(default_factory=lambda: _torchrun_env("NNODES", 1, int))
    node_rank: int = field(default_factory=lambda: _torchrun_env("NODE_RANK", _torchrun_env("GROUP_RANK", 0, int),
                                                                 int))
    master_addr: str = field(default_factory=lambda: _torchrun_env("MASTER_ADDR", "127.0.0.1"))
    # None: a free port
    master_port: int | None = field(default_factory=lambda: _torchrun_env("MASTER_PORT", None, int))
    # Mixture of experts: share whole experts over the tensor-parallel ranks instead of slicing each one
    # (tokenloom.distributed.expert_parallel); placement linear | round_robin (None: linear).
    enable_expert_parallel: bool = False
    expert_placement_strategy: str | None = None
    # Expert parallel load balancing (tokenloom.distributed.eplb): vLLM's --enable-eplb, --eplb-config and
    # --num-redundant-experts (the same as eplb_config's key; FastDeploy's eplb_config spellings are accepted).
    enable_eplb: bool = False
    eplb_config: EPLBConfig | None = None
    num_redundant_experts: int | None = None
    # Engine replicas behind one API server (engine/dp_client.py); each runs its own TP group.
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        _check(self.data_parallel_size >= 1, f"data_parallel_size must be >= 1 (got {self.data_parallel_size})")
        _check(self.data_parallel_size == 1 or self.nnodes == 1,
               f"data_parallel_size {self.data_parallel_size} runs its replicas on one node; --nnodes "
               f"{self.nnodes} is not supported with it (run one server per node behind `tokenloom router`)")
        _check(self.data_parallel_size == 1 or self.tensor_parallel_size == 1 or self.master_port is None,
               f"data_parallel_size {self.data_parallel_size} with tensor_parallel_size "
               f"{self.tensor_parallel_size}: each replica's TP group picks its own free port, so --master-port "
               f"cannot be set")
        _check(self.tensor_parallel_size >= 1,
               f"tensor_parallel_size must be >= 1 (got {self.tensor_parallel_size})")
        _check(self.distributed_executor_backend in (None, *EXECUTOR_BACKENDS),
               f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)} "
               f"(got {self.distributed_executor_backend!r})")
        _check(not (self.distributed_executor_backend == "uni" and self.world_size > 1),
               f"distributed_executor_backend 'uni' runs one rank; tensor_parallel_size "
               f"{self.tensor_parallel_size} needs 'mp'")
        _check(self.nnodes >= 1, f"nnodes must be >= 1 (got {self.nnodes})")
        _check(0 <= self.node_rank < self.nnodes, f"node_rank must be in 0..{self.nnodes - 1} (got {self.node_rank})")
        _check(self.world_size % self.nnodes == 0,
               f"tensor_parallel_size {self.tensor_parallel_size} must split evenly over {self.nnodes} nodes")
        _check(self.master_port is None or 0 < self.master_port < 65536,
               f"master_port must be in 1..65535 (got {self.master_port})")
        _check(self.expert_placement_strategy in (None, "linear", "round_robin"),
               f"expert_placement_strategy must be linear or round_robin (got {self.expert_placement_strategy!r})")
        _check(self.expert_placement_strategy is None or self.enable_expert_parallel,
               "expert_placement_strategy applies only with enable_expert_parallel (--enable-expert-parallel)")
        self._check_eplb()

    def _check_eplb(self) -> None:
        self.eplb_config = EPLBConfig.parse(self.eplb_config)
        if self.eplb_config is not None and self.eplb_config.enable_eplb is not None:
            self.enable_eplb = self.enable_eplb or self.eplb_config.enable_eplb  # FastDeploy's key
        _check(not self.enable_eplb or self.enable_expert_parallel,
               "enable_eplb balances the experts of expert parallelism: it needs enable_expert_parallel "
               "(--enable-expert-parallel)")
        _check(self.enable_eplb or (self.eplb_config is None and self.num_redundant_experts is None),
               "eplb_config and num_redundant_experts apply only with enable_eplb (--enable-eplb)")
        if self.num_redundant_experts is None:
            return
        _check(isinstance(self.num_redundant_experts, int) and self.num_redundant_experts >= 0,
               f"num_redundant_experts must be an int >= 0 (got {self.num_redundant_experts!r})")
        in_json = self.eplb_config.num_redundant_experts if self.eplb_config is not None else 0
        _check(in_json in (0, self.num_redundant_experts),
               f"num_redundant_experts {self.num_redundant_experts} contradicts eplb_config's {in_json}")
        self.eplb_config = replace(self.eplb_config or EPLBConfig(), num_redundant_experts=self.num_redundant_experts)

    @property
    def eplb(self) -> EPLBConfig | None:
        """The load balancer's settings when it is on, else None."""
        if not self.enable_eplb:
            return None
        return self.eplb_config or EPLBConfig()

    @property
    def redundant_experts(self) -> int:
        """Physical expert slots beyond one per expert, over all ranks (0 without the balancer)."""
        return self.eplb.num_redundant_experts if self.eplb is not None else 0

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    @property
    def rendezvous_port(self) -> int | None:
        """master_port, or torch's usual 29500 when several nodes must agree on it; None: pick a free one."""
        if self.master_port is not None:
            return self.master_port
        return DEFAULT_MASTER_PORT if self.nnodes > 1 else None

    @property
    def executor_backend(self) -> str:
        return self.distributed_executor_backend or ("uni" if self.world_size == 1 else "mp")

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks this node starts."""
        return range(self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node)


@dataclass
class LimitsConfig:
    """Caps on what one request may ask for."""

    max_n: int = 16
    max_logprobs: int = 20
    max_stop_sequences: int = 16
    max_stop_length: int = 256
    max_logit_bias: int = 1024
    max_bad_words: int = 128

    def __post_init__(self) -> None:
        for f in fields(self):
            _check(getattr(self, f.name) >= 0, f"{f.name} must be >= 0 (got {getattr(self, f.name)})")


@dataclass
class MultiModalConfig:
    """Images in prompts (tokenloom/multimodal, docs/multimodal.md): what a request may carry, where images may
    come from, and the encoder cache."""

    # vLLM's --limit-mm-per-prompt: the most items of each modality in one prompt, as JSON ({"image": 4}).
    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": 4})
    # 20 MiB: OpenAI's own limit on an image in a request.
    max_image_bytes: int = 20 * 1024 * 1024
    # 7680 x 4320 (8K): larger than any tower's input by far, and ~100 MiB decoded as RGB, so a file that
    # decodes to more is refused from its header before any pixel is decoded.
    max_image_pixels: int = 7680 * 4320
    # vLLM's --allowed-media-domains: hosts an http(s) image URL may name; None: no fetching at all.
    allowed_media_domains: list[str] | None = None
    # vLLM's --allowed-local-media-path: a directory file:// image URLs may read under; None: none.
    allowed_local_media_path: str | None = None
    media_fetch_timeout: float = 5.0  # seconds for one http(s) image, connect to last byte (vLLM's default)
    # Encoder rows (tokens) kept between steps and requests, keyed by the image's content hash; FastDeploy's
    # max_encoder_cache. 4096 holds seven LLaVA-1.5 images (576 rows each); 0 keeps no rows past the step that
    # encoded them (no reuse).
    max_encoder_cache: int = 4096

    def __post_init__(self) -> None:
        self.limit_mm_per_prompt = _parse_limit_mm(self.limit_mm_per_prompt)
        _check(self.max_image_bytes >= 1, f"max_image_bytes must be >= 1 (got {self.max_image_bytes})")
        _check(self.max_image_pixels >= 1, f"max_image_pixels must be >= 1 (got {self.max_image_pixels})")
        _check(self.media_fetch_timeout > 0, f"media_fetch_timeout must be > 0 s (got {self.media_fetch_timeout})")
        _check(self.max_encoder_cache >= 0,
               f"max_encoder_cache must be >= 0 tokens (0: no reuse; got {self.max_encoder_cache})")
        if isinstance(self.allowed_media_domains, str):
            self.allowed_media_domains = [d for d in self.allowed_media_domains.split(",") if d]
        if self.allowed_local_media_path is not None:
            _check(os.path.isdir(self.allowed_local_media_path),
                   f"allowed_local_media_path {self.allowed_local_media_path!r} is not a directory")
            self.allowed_local_media_path = os.path.realpath(self.allowed_local_media_path)

    @property
    def max_images(self) -> int:
        return self.limit_mm_per_prompt.get("image", 0)


MODALITIES = ("image",)


def _parse_limit_mm(value) -> dict[str, int]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--limit-mm-per-prompt is not valid JSON: {e}") from None
    _check(isinstance(value, dict), f"limit_mm_per_prompt must be a JSON object such as {{\"image\": 4}} "
           f"(got {value!r})")
    unknown = sorted(set(value) - set(MODALITIES))
    _check(not unknown, f"limit_mm_per_prompt: unknown modality {', '.join(unknown)} (known: {', '.join(MODALITIES)})")
    for k, v in value.items():
        _check(isinstance(v, int) and not isinstance(v, bool) and v >= 0,
               f"limit_mm_per_prompt[{k!r}] must be an integer >= 0 (got {v!r})")
    return dict(value)


SPEC_METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """vLLM's --speculative-config: which proposer drafts tokens and how many the target verifies per step."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1  # shortest n-gram matched against the request's own tokens
    prompt_lookup_max: int = 4  # longest n-gram tried first
    disable_by_batch_size: int | None = None  # no speculation while more requests than this run
    model: str | None = None  # the draft model (method "draft_model"): a path, GGUF file or HF folder

    def __post_init__(self) -> None:
        _check_spec_method(self.method)
        _check(isinstance(self.num_speculative_tokens, int) and 1 <= self.num_speculative_tokens <= 16,
               f"num_speculative_tokens must be in 1..16 (got {self.num_speculative_tokens!r})")
        _check(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
               f"need 1 <= prompt_lookup_min <= prompt_lookup_max (got {self.prompt_lookup_min}, "
               f"{self.prompt_lookup_max})")
        _check(self.disable_by_batch_size is None or self.disable_by_batch_size >= 1,
               f"disable_by_batch_size must be >= 1 (got {self.disable_by_batch_size})")
        _check(self.method != "draft_model" or bool(self.model),
               'speculative method "draft_model" needs "model": the draft model\'s path')

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """From a dict, a JSON string (the CLI flag), an instance or None."""
        return parse_json_config(cls, value, "speculative_config",
                                 lambda d: _check_spec_method(d.get("method", cls.method)))


def _check_spec_method(method: object) -> None:
    _check(method in SPEC_METHODS,
           f"speculative method {method!r} is not supported (supported: {', '.join(SPEC_METHODS)})")


@dataclass
class EarlyStopConfig:
    """FastDeploy's early_stop_config: end a sequence whose most likely next token has stayed above
    `threshold` probability for `window_size` steps in a row (a model stuck repeating itself), by forcing
    its end-of-sequence token (finish_reason "stop"). Off unless enable_early_stop."""

    enable_early_stop: bool = False
    strategy: str = "repetition"
    window_size: int = 3000
    threshold: float = 0.99

    def __post_init__(self) -> None:
        _check(self.strategy == "repetition",
               f"early_stop_config strategy must be 'repetition' (got {self.strategy!r})")
        _check(isinstance(self.window_size, int) and self.window_size >= 1,
               f"early_stop_config window_size must be an int >= 1 (got {self.window_size!r})")
        _check(isinstance(self.threshold, (int, float)) and 0.0 < self.threshold < 1.0,
               f"early_stop_config threshold must be in (0, 1) (got {self.threshold!r})")

    @classmethod
    def parse(cls, value) -> "EarlyStopConfig | None":
        return parse_json_config(cls, value, "early_stop_config")


# KV connectors: KV transfer for prefill/decode disaggregation (vLLM's --kv-transfer-config, FastDeploy's
# --splitwise-role) and the KV offload tier (vLLM's --kv-offloading-backend / --kv-offloading-size, plus a
# directory).
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_CONNECTORS = ("ZmqConnector",)
LOAD_FAILURE_POLICIES = ("recompute", "fail")
TRANSPORTS = ("tcp", "ipc")
# FastDeploy's --splitwise-role names for vLLM's kv_role; "mixed" runs prefill and decode in one instance.
SPLITWISE_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "mixed": None}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass
class KVTransferConfig:
    kv_connector: str = "ZmqConnector"
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"  # where a producer listens for pulls (another machine's decoder: its own IP)
    kv_port: int = 0  # 0: a free port (tcp); with ipc, part of the socket's file name
    kv_transport: str = "tcp"  # tcp | ipc (one machine: a Unix socket)
    kv_load_failure_policy: str = "recompute"  # a failed pull: recompute the prompt locally, or fail the request
    # Seconds a producer keeps a finished prefill's blocks for its decoder; then they are freed (vLLM's
    # abort-request timeout is 480 s for RDMA setups; a decoder here pulls within a step or two).
    kv_lease_s: float = 60.0
    # Seconds a consumer waits for one pull; past it the load has failed (and follows the policy).
    kv_transfer_timeout_s: float = 10.0
    # Who may set kv_transfer_params over HTTP (tokenloom/kv_transfer/trust.py): the sender of this value in the
    # X-KV-Transfer-Secret header (the router: `tokenloom router --pd --kv-secret`); else TOKENLOOM_KV_SECRET.
    kv_secret: str | None = field(default_factory=lambda: os.environ.get("TOKENLOOM_KV_SECRET") or None)
    # Consumer: the producers it may pull from, each a host (any port) or a full tcp://host:port or ipc://path
    # address; a remote_address elsewhere is refused. None: wherever the (trusted) sender says.
    kv_producers: list[str] | None = None

    def __post_init__(self) -> None:
        _check(self.kv_connector in KV_CONNECTORS,
               f"kv_connector must be one of {', '.join(KV_CONNECTORS)} (got {self.kv_connector!r})")
        _check(self.kv_role in KV_ROLES, f"kv_role must be one of {', '.join(KV_ROLES)} (got {self.kv_role!r})")
        _check(self.kv_transport in TRANSPORTS,
               f"kv_transport must be one of {', '.join(TRANSPORTS)} (got {self.kv_transport!r})")
        _check(self.kv_load_failure_policy in LOAD_FAILURE_POLICIES,
               f"kv_load_failure_policy must be one of {', '.join(LOAD_FAILURE_POLICIES)} "
               f"(got {self.kv_load_failure_policy!r})")
        _check(isinstance(self.kv_port, int) and 0 <= self.kv_port < 65536,
               f"kv_port must be in 0..65535 (got {self.kv_port!r})")
        _check(self.kv_lease_s > 0, f"kv_lease_s must be > 0 (got {self.kv_lease_s})")
        _check(self.kv_transfer_timeout_s > 0,
               f"kv_transfer_timeout_s must be > 0 (got {self.kv_transfer_timeout_s})")
        _check(self.kv_secret is None or (isinstance(self.kv_secret, str) and len(self.kv_secret) >= 16),
               "kv_secret must be a string of at least 16 characters (e.g. `openssl rand -hex 16`)")
        _check(self.kv_producers is None or (isinstance(self.kv_producers, list) and self.kv_producers
                                             and all(isinstance(p, str) and p for p in self.kv_producers)),
               f"kv_producers must be a non-empty list of hosts or tcp:// / ipc:// addresses "
               f"(got {self.kv_producers!r})")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value) -> "KVTransferConfig | None":
        """From a dict, a JSON string (the CLI flag), an instance or None."""
        return parse_json_config(cls, value, "kv_transfer_config")

    @classmethod
    def from_splitwise_role(cls, role: str) -> "KVTransferConfig | None":
        _check(role in SPLITWISE_ROLES,
               f"splitwise_role must be one of {', '.join(SPLITWISE_ROLES)} (got {role!r})")
        kv_role = SPLITWISE_ROLES[role]
        return None if kv_role is None else cls(kv_role=kv_role)


OFFLOADING_BACKENDS = ("native",)


@dataclass
class KVOffloadConfig:
    """Evicted prefix-cache blocks go to host memory, or to `path` (a directory) when it is set."""

    backend: str = "native"
    size_gib: float = 1.0  # bound on the tier: host bytes, or disk bytes under path
    path: str | None = None

    def __post_init__(self) -> None:
        _check(self.backend in OFFLOADING_BACKENDS,
               f"kv_offloading_backend must be one of {', '.join(OFFLOADING_BACKENDS)} (got {self.backend!r})")
        _check(self.size_gib > 0, f"kv_offloading_size must be > 0 GiB (got {self.size_gib})")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)
    log_stats_interval: float = 10.0  # seconds between engine log lines; 0 = off
    # Structured outputs: <think> parser whose end marker starts constraints (tokenloom.structured.reasoning),
    # and the tool-call format the server parses (tokenloom.structured.tool_parsers).
    reasoning_parser: str | None = None
    tool_call_parser: str | None = "hermes"
    speculative_config: SpeculativeConfig | None = None
    early_stop_config: EarlyStopConfig | None = None
    # KV transfer (vLLM's --kv-transfer-config), or FastDeploy's alias prefill | decode | mixed.
    kv_transfer_config: KVTransferConfig | None = None
    splitwise_role: str | None = None
    # KV offload tier: evicted prefix-cache blocks to host memory, or to kv_offloading_path (kept across restarts).
    kv_offloading_backend: str | None = None
    kv_offloading_size: float = 1.0  # GiB
    kv_offloading_path: str | None = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.early_stop_config = EarlyStopConfig.parse(self.early_stop_config)
        spec = self.speculative_config
        # The draft model runs in the worker next to rank 0's sampler; sharding it is not built yet.
        _check(spec is None or spec.method != "draft_model" or self.parallel.tensor_parallel_size == 1,
               "speculative method 'draft_model' needs tensor_parallel_size 1 (use 'ngram' with tensor parallelism)")
        self._check_kv_connectors()
        self._check_async_scheduling()
        if self.reasoning_parser is not None:
            _check(self.reasoning_parser in REASONING_PARSERS, f"reasoning_parser must be one of "
                   f"{', '.join(sorted(REASONING_PARSERS))} (got {self.reasoning_parser!r})")
        if self.tool_call_parser is not None:
            _check(self.tool_call_parser in TOOL_PARSERS, f"tool_call_parser must be one of "
                   f"{', '.join(sorted(TOOL_PARSERS))} (got {self.tool_call_parser!r})")

    def _check_kv_connectors(self) -> None:
        self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        if self.splitwise_role is not None:
            by_role = KVTransferConfig.from_splitwise_role(self.splitwise_role)
            if self.kv_transfer_config is None:
                self.kv_transfer_config = by_role
            else:
                _check(by_role is not None and by_role.kv_role == self.kv_transfer_config.kv_role,
                       f"splitwise_role {self.splitwise_role!r} contradicts kv_role "
                       f"{self.kv_transfer_config.kv_role!r} in kv_transfer_config")
        self.kv_offload_config  # validates
        _check(self.kv_transfer_config is None or self.kv_offloading_backend is None,
               "kv_transfer_config and kv_offloading_backend cannot be combined yet (one KV connector per engine)")
        _check(self.kv_offloading_backend is None or self.cache.enable_prefix_caching,
               "kv_offloading_backend needs prefix caching (offloaded blocks are found by their prefix hash)")

    def _check_async_scheduling(self) -> None:
        """What overlapped scheduling cannot run with yet: each needs the step's outputs before the next step
        is scheduled (drafts to verify, KV transfers to account) or every rank to hold the sampled tokens."""
        if not self.scheduler.async_scheduling:
            return
        _check(self.speculative_config is None,
               "async_scheduling cannot be combined with speculative decoding (--speculative-config) yet")
        _check(self.kv_transfer_config is None and self.kv_offloading_backend is None,
               "async_scheduling cannot be combined with a KV connector (--kv-transfer-config, --splitwise-role, "
               "--kv-offloading-backend) yet")
        _check(self.parallel.tensor_parallel_size == 1,
               f"async_scheduling needs tensor_parallel_size 1 (got {self.parallel.tensor_parallel_size}): only "
               "the first rank samples, so the other ranks could not feed the sampled tokens forward")

    @property
    def kv_offload_config(self) -> KVOffloadConfig | None:
        if self.kv_offloading_backend is None:
            return None
        return KVOffloadConfig(self.kv_offloading_backend, self.kv_offloading_size, self.kv_offloading_path)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from flat keyword arguments (``LLM(model, max_num_seqs=8, ...)``)."""
        parts = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                 "parallel": ParallelConfig, "limits": LimitsConfig, "lora": LoRAConfig,
                 "multimodal": MultiModalConfig}
        values: dict[str, dict] = {name: {} for name in parts}
        top = {}
        for key, value in kwargs.items():
            owner = next((n for n, c in parts.items() if key in {f.name for f in fields(c)}), None)
            if owner is not None:
                values[owner][key] = value
            elif key in {f.name for f in fields(cls)}:
                top[key] = value
            else:
                raise ConfigError(f"unknown engine argument {key!r}")
        return cls(**{n: parts[n](**v) for n, v in values.items()}, **top)

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> "EngineConfig":
        kwargs = {}
        for part in (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, LimitsConfig, LoRAConfig,
                     MultiModalConfig):
            for f in fields(part):
                if getattr(ns, f.name, None) is not None:
                    kwargs[f.name] = getattr(ns, f.name)
        for name in ("speculative_config", "early_stop_config"):
            if getattr(ns, name, None):
                kwargs[name] = getattr(ns, name)
        for name in ("kv_transfer_config", "splitwise_role", "kv_offloading_backend", "kv_offloading_size",
                     "kv_offloading_path"):
            if getattr(ns, name, None) is not None:
                kwargs[name] = getattr(ns, name)
        for name in ("reasoning_parser", "tool_call_parser"):
            if getattr(ns, name, None) is not None:
                kwargs[name] = None if ns.__dict__[name] == "none" else ns.__dict__[name]
        if getattr(ns, "no_enable_prefix_caching", False):
            kwargs["enable_prefix_caching"] = False
        return cls.from_kwargs(**kwargs)


# Called with each TOKENLOOM_<NAME> that env_default looks up, while set: how the generated configuration page
# learns which flag reads which variable (tokenloom/entrypoints/config_doc.py).
env_lookup_listener: Callable[[str], None] | None = None


def env_default(name: str, default, kind=str):
    """The value of TOKENLOOM_<NAME> converted to `kind` (bool: 1/true/yes/on), else `default`."""
    if env_lookup_listener is not None:
        env_lookup_listener("TOKENLOOM_" + name.upper())
    raw = os.environ.get("TOKENLOOM_" + name.upper())
    if raw is None:
        return default
    if kind is bool:
        return is_true(raw)
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"environment variable TOKENLOOM_{name.upper()}={raw!r} is not a valid {kind.__name__}")


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = True) -> None:
    """Add the engine's flags; defaults come from TOKENLOOM_<NAME> or the dataclasses."""
    if model_positional:
        parser.add_argument("model", nargs="?", default=env_default("model", None, str),
                            help=f"GGUF file, Hugging Face style folder, or {EMBEDDED_MODEL!r} (default)")
    g = parser.add_argument_group("engine")

    def opt(name: str, kind, help: str) -> None:
        g.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=env_default(name, None, kind),
                       help=help)

    opt("dtype", str, "weights/activations dtype: auto|float32|bfloat16|float16 "
        "(auto: float32 on CPU, bfloat16 on CUDA)")
    opt("matmul_dtype", str, "dtype of the linear layers' weights and inputs: auto (= --dtype)|float32|bfloat16|"
        "float16; bfloat16 under float32 activations is the fast CPU mode (see docs/performance.md for its accuracy)")
    opt("device", str, "auto|cpu|cuda|cuda:N")
    opt("quantized_matmul", str, "quantized GGUF weights on the native CPU kernels: exact (default; float32 "
        "activations, the float32 model's results) | w4a8 (int8 activations per 32 values, faster, lossier)")
    opt("attention_backend", str, "attention backend: auto (default: native on CPU in float32 when the kernels "
        "load, flashinfer on CUDA when installed, else torch) | torch (the reference, CPU and CUDA) | native (C++ "
        "paged attention, CPU) | flashinfer (CUDA, float16/bfloat16)")
    g.add_argument("--enforce-eager", dest="enforce_eager", action="store_true",
                   default=env_default("enforce_eager", None, bool),
                   help="run every step layer by layer: no CUDA graphs for decode steps on CUDA, no native decoder "
                        "stack on the CPU (tokenloom.model.native_stack)")
    g.add_argument("--cuda-graph-sizes", dest="cuda_graph_sizes", type=int, nargs="+", default=None,
                   help="CUDA: decode batch sizes to capture as graphs (default 1 2 4 8 16 24 ... --max-num-seqs)")
    opt("runner", str, "generate | pooling (embeddings, /v1/embeddings) | auto (default: pooling for an encoder "
        "such as BERT, generate otherwise)")
    opt("convert", str, "embed: serve a decoder model as an embedding model (last-token pooling); auto | none")
    opt("mmproj", str, "llama.cpp's multimodal projector GGUF (vision tower and projector) for a GGUF text model: "
        "images in, text out (LLaVA, Gemma 3, Qwen2.5-VL; docs/multimodal.md)")
    opt("max_model_len", int, "context length; default the model's, clamped to the KV cache")
    opt("seed", int, "seed for requests without their own seed")
    opt("block_size", int, "tokens per KV block (default 16)")
    opt("kv_cache_memory", float, "GiB of KV cache on CPU (default 2)")
    opt("gpu_memory_utilization", float, "share of GPU memory for weights, activations and KV cache (default 0.9)")
    opt("kv_cache_dtype", str, "dtype of the stored keys and values: auto (= --dtype)|float32|bfloat16|float16|"
        "int8 (also fp8, fp8_e4m3); bfloat16 halves the bytes decode attention reads, int8 (8-bit values and a "
        "scale per token and head) holds 1.9x bfloat16's tokens")
    opt("num_blocks", int, "number of KV blocks (overrides the memory budget)")
    opt("max_num_seqs", int, "most requests running at once (default 64)")
    opt("max_num_batched_tokens", int, "token budget of one engine step (default 512)")
    opt("long_prefill_token_threshold", int, "most prompt tokens of one request in one step (default 512)")
    g.add_argument("--async-scheduling", dest="async_scheduling", action="store_true",
                   default=env_default("async_scheduling", None, bool),
                   help="overlap the engine's scheduling and output processing with the model's forward: step "
                        "N+1 is scheduled and launched before step N's outputs are applied (docs/performance.md)")
    g.add_argument("-tp", "--tensor-parallel-size", dest="tensor_parallel_size", type=int,
                   default=env_default("tensor_parallel_size", None, int),
                   help="ranks that share the model (tensor parallel; default 1)")
    g.add_argument("-dp", "--data-parallel-size", dest="data_parallel_size", type=int,
                   default=env_default("data_parallel_size", None, int),
                   help="engine replicas behind this server (data parallel; each its own TP group; default 1)")
    opt("distributed_executor_backend", str, "uni (the worker in the engine process; size 1) | mp (one process "
        "per rank); default uni at size 1, mp above")
    opt("nnodes", int, "machines the ranks span (default 1, or torchrun's NNODES)")
    opt("node_rank", int, "this machine's index among --nnodes; a node other than 0 runs workers only")
    opt("master_addr", str, "address of node 0, where the ranks meet (default 127.0.0.1, or MASTER_ADDR)")
    opt("master_port", int, "port on node 0 for the rendezvous (default: a free one on a single node; "
        "MASTER_PORT if set)")
    opt("max_n", int, "largest n / best_of a request may ask for (default 16)")
    opt("max_logprobs", int, "largest logprobs / top_logprobs a request may ask for (default 20)")
    g.add_argument("--logits-processors", dest="logits_processors", nargs="+", default=None,
                   help="module:Class names of tokenloom.LogitsProcessor subclasses, applied in order before "
                        "sampling (see docs/serving.md)")
    opt("early_stop_config", str, 'FastDeploy\'s early stop, as JSON: {"enable_early_stop": true, "window_size": '
        '3000, "threshold": 0.99}: end a sequence whose top token stayed above threshold for window_size steps')
    opt("logprobs_mode", str, "what logprobs report: raw_logprobs (default: the model's distribution) | "
        "processed_logprobs (the one sampled from, after penalties, temperature and top-k/p) | raw_logits | "
        "processed_logits; a request's logprobs_mode overrides it")
    opt("reasoning_parser", str, "split <think>...</think> into reasoning_content: think | qwen3 | deepseek_r1 "
        "(structured-output constraints then apply after the reasoning)")
    opt("tool_call_parser", str, "tool-call format parsed from chat output: hermes (default) | none")
    opt("speculative_config", str, 'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 1, "prompt_lookup_max": 4, "disable_by_batch_size": 8}, or '
        '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}')
    g.add_argument("--enable-expert-parallel", dest="enable_expert_parallel", action="store_true",
                   default=env_default("enable_expert_parallel", None, bool),
                   help="mixture-of-experts models: share whole experts over the tensor-parallel ranks "
                        "(default: slice every expert)")
    opt("expert_placement_strategy", str, "with --enable-expert-parallel: linear (rank r holds a contiguous "
        "range of experts; default) | round_robin (expert e on rank e %% size)")
    g.add_argument("--enable-eplb", dest="enable_eplb", action="store_true",
                   default=env_default("enable_eplb", None, bool),
                   help="with --enable-expert-parallel: re-place the experts over the ranks from the load they "
                        "saw, between steps (docs/parallelism.md)")
    opt("eplb_config", str, 'the load balancer, as JSON: {"window_size": 1000, "step_interval": 3000, '
        '"num_redundant_experts": 0, "log_balancedness": false}: every step_interval steps, place the experts by '
        "the tokens routed to each over the last window_size steps, with num_redundant_experts extra copies of "
        "the busiest (FastDeploy's redundant_experts_num is accepted)")
    opt("num_redundant_experts", int, "with --enable-eplb: extra expert copies over all ranks (the same as "
        "--eplb-config's num_redundant_experts; default 0)")
    opt("kv_transfer_config", str, 'KV transfer for prefill/decode disaggregation, as JSON: {"kv_connector": '
        '"ZmqConnector", "kv_role": "kv_producer|kv_consumer|kv_both", "kv_ip": "127.0.0.1", "kv_port": 0, '
        '"kv_transport": "tcp|ipc", "kv_load_failure_policy": "recompute|fail", "kv_lease_s": 60, '
        '"kv_transfer_timeout_s": 10, "kv_secret": SECRET, "kv_producers": ["10.0.0.5", "tcp://10.0.0.6:5600"]}; '
        'kv_secret (default TOKENLOOM_KV_SECRET) is the one `tokenloom router --pd` sends')
    opt("splitwise_role", str, "prefill | decode | mixed: FastDeploy's alias for kv_role kv_producer | kv_consumer | "
        "no transfer")
    opt("kv_offloading_backend", str, "native: save evicted prefix-cache blocks to host memory (or to "
        "--kv-offloading-path) and load them back on a later hit")
    opt("kv_offloading_size", float, "GiB the offload tier may hold (default 1)")
    opt("kv_offloading_path", str, "directory for the offload tier (blocks survive a restart); default host memory")
    g.add_argument("--enable-lora", dest="enable_lora", action="store_true",
                   default=env_default("enable_lora", None, bool),
                   help="serve LoRA adapters (docs/lora.md): requests name one by their model field")
    opt("max_loras", int, "LoRA adapters resident at once, and so in one step (default 1)")
    opt("max_lora_rank", int, "highest LoRA rank served (default 16)")
    opt("max_cpu_loras", int, "LoRA adapters kept read in host memory (default --max-loras)")
    opt("lora_dtype", str, "dtype of the LoRA slots: auto (= --dtype)|float32|bfloat16|float16; 16 bits halve the "
        "bytes a step with adapter rows reads (an adapter saved in that dtype is held exactly)")
    opt("limit_mm_per_prompt", str, 'most images in one prompt, as JSON: {"image": 4} (default); 0 refuses images')
    opt("max_image_bytes", int, "largest image a request may send, in bytes (default 20 MiB)")
    opt("max_image_pixels", int, "largest decoded image, width x height (default 7680 x 4320); checked from the "
        "header, before decoding")
    g.add_argument("--allowed-media-domains", dest="allowed_media_domains", nargs="+", default=None,
                   help="hosts whose http(s) image URLs the server fetches (default: none; only data: URLs)")
    opt("allowed_local_media_path", str, "directory whose files file:// image URLs may name (default: none)")
    opt("media_fetch_timeout", float, "seconds to fetch one http(s) image (default 5)")
    g.add_argument("--max-encoder-cache", "--max_encoder_cache", dest="max_encoder_cache", type=int,
                   default=env_default("max_encoder_cache", None, int),
                   help="vision encoder rows kept for reuse across prefill chunks and requests, in tokens "
                        "(default 4096; 0: no reuse, each request encodes its images again; FastDeploy's "
                        "max_encoder_cache)")
    g.add_argument("--no-enable-prefix-caching", dest="no_enable_prefix_caching", action="store_true",
                   default=env_default("no_enable_prefix_caching", False, bool),
                   help="turn automatic prefix caching off")
