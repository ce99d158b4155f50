"""vLLM's and llama.cpp's spellings of the command-line flags.

A command line copied from `vllm serve` or `llama-server` should work after changing the
program name. Three kinds of flags live here:

* aliases of tokenloom's own options (``--num-gpu-blocks-override`` = ``--num-blocks``,
  llama.cpp's ``-c``/``--ctx-size`` = ``--max-model-len``, ``-np``/``--parallel`` = ``--max-num-seqs``,
  FastDeploy's ``--enable-overlap-schedule`` = ``--async-scheduling``);
* flags whose vLLM meaning tokenloom already has, accepted as such (``--enable-prefix-caching``,
  ``--trust-remote-code``: tokenloom never runs a model's own code, ``--enable-chunked-prefill``:
  prefill is always chunked);
* flags for features tokenloom lacks: they fail at parse time with one line naming the flag
  (`UNSUPPORTED`), so nothing is silently ignored; llama.cpp's ``-ngl`` is refused only for a real
  partial offload (`habits.gpu_layers_device`).
"""
from __future__ import annotations

import argparse
import os
import sys

from tokenloom.config import ConfigError, env_default
from tokenloom.entrypoints.habits import gpu_layers_device

# flag -> why it is refused. Each spelling vLLM or llama.cpp uses is listed.
UNSUPPORTED: dict[tuple[str, ...], str] = {
    ("--speculative-model", "--num-speculative-tokens", "--model-draft", "-md"):
        "this spelling of speculative decoding is not supported; use --speculative-config "
        "'{\"method\": \"draft_model\", \"model\": PATH, \"num_speculative_tokens\": 4}' (or \"ngram\")",
    ("--pipeline-parallel-size", "-pp"): "pipeline parallelism is not supported",
    ("--cpu-offload-gb",): "CPU offload of weights is not supported",
    ("--swap-space",): "KV-cache swapping is not supported (preempted requests are recomputed)",
    ("--tokenizer",): "a separate tokenizer is not supported: the tokenizer comes with the model",
    ("--revision", "--tokenizer-revision", "--download-dir", "--hf-token"):
        "tokenloom never downloads models: give a local GGUF file or model folder",
    ("--tool-parser-plugin",): "tool-parser plugins are not supported; see --tool-call-parser",
    ("--middleware",): "custom ASGI middleware is not supported",
    ("--rope-scaling", "--rope-freq-base", "--rope-freq-scale"):
        "RoPE overrides are not supported: the model's own RoPE settings are used",
}

# --quantization values tokenloom reads (a quantized GGUF file; on the CPU its blocks stay quantized).
QUANTIZATIONS = ("gguf",)
LOAD_FORMATS = ("auto", "gguf", "safetensors")


class _Unsupported(argparse.Action):
    def __init__(self, option_strings, dest, reason: str, **kw):
        kw.setdefault("nargs", "?")
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kw)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None):
        raise ConfigError(f"{option_string}: {self.reason}")


def add_unsupported_args(parser: argparse.ArgumentParser) -> None:
    """Register every spelling in UNSUPPORTED that the parser does not already have."""
    taken = set(parser._option_string_actions)  # noqa: SLF001 - argparse has no public accessor
    for flags, reason in UNSUPPORTED.items():
        free = [f for f in flags if f not in taken]
        if free:
            parser.add_argument(*free, dest="unsupported_" + free[0].lstrip("-").replace("-", "_"),
                                action=_Unsupported, reason=reason, default=None)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Flags of every command that runs a model: -m/--model handled by the caller; threads, aliases."""
    g = parser.add_argument_group("compatibility (vLLM and llama.cpp spellings)")
    g.add_argument("-t", "--threads", dest="threads", type=int, default=env_default("threads", None, int),
                   help="CPU threads for the model's compute (default: PyTorch's, one per core)")
    g.add_argument("-c", "--ctx-size", dest="max_model_len", type=int, default=argparse.SUPPRESS,
                   help="llama.cpp's name of --max-model-len")
    g.add_argument("--num-gpu-blocks-override", dest="num_blocks", type=int, default=argparse.SUPPRESS,
                   help="vLLM's name of --num-blocks")
    g.add_argument("--enable-prefix-caching", dest="enable_prefix_caching_flag", action="store_true",
                   default=False, help="automatic prefix caching (on by default)")
    g.add_argument("--enable-overlap-schedule", dest="async_scheduling", action="store_true",
                   default=argparse.SUPPRESS, help="FastDeploy's name of --async-scheduling")
    g.add_argument("--trust-remote-code", action="store_true", default=False,
                   help="accepted for vLLM command lines; tokenloom never runs code shipped with a model")
    g.add_argument("--enable-chunked-prefill", action="store_true", default=False,
                   help="accepted for vLLM command lines; long prompts are always prefilled in chunks")
    g.add_argument("--quantization", "-q", dest="quantization", default=None,
                   help="accepted: gguf (quantized GGUF files are read as such); other methods are refused")
    g.add_argument("--load-format", dest="load_format", default=None,
                   help="auto | gguf | safetensors (the format is told from the model path)")
    g.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", dest="gpu_layers", type=int, default=None,
                   help="llama.cpp's layers on the GPU: every layer (or -1) = --device cuda, 0 = --device cpu; "
                        "a partial offload is refused")
    g.add_argument("--chat-template", dest="chat_template", default=env_default("chat_template", None, str),
                   help="a Jinja chat template, as a file path or inline, replacing the model's")
    add_unsupported_args(parser)


def check_common_args(ns: argparse.Namespace) -> None:
    """Refuse values that have no meaning here; one line naming the flag."""
    q = getattr(ns, "quantization", None)
    if q is not None and q.lower() not in QUANTIZATIONS:
        raise ConfigError(f"--quantization {q}: not supported; tokenloom reads quantized GGUF files "
                          f"(--quantization gguf) and unquantized safetensors")
    fmt = getattr(ns, "load_format", None)
    if fmt is not None and fmt not in LOAD_FORMATS:
        raise ConfigError(f"--load-format {fmt}: not supported (one of {', '.join(LOAD_FORMATS)})")
    if getattr(ns, "threads", None) is not None and ns.threads < 1:
        raise ConfigError(f"--threads must be >= 1 (got {ns.threads})")
    if getattr(ns, "gpu_layers", None) is not None:
        ns.device = gpu_layers_device(ns.gpu_layers, ns.model, ns.device) or ns.device


def apply_threads(threads: int | None) -> None:
    """Set the compute threads of this process and of the engine processes it starts."""
    if threads is None:
        return
    os.environ["OMP_NUM_THREADS"] = str(threads)  # torch reads it when it is first imported (engine processes)
    torch = sys.modules.get("torch")  # the API server process never imports it (it would cost ~180 MB there)
    if torch is not None:
        torch.set_num_threads(threads)


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's contents, or the argument itself when it is a Jinja template."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{%" in value or "{{" in value:
        return value
    raise ConfigError(f"--chat-template {value}: no such file, and not a Jinja template")
