"""The environment variables tokenloom reads besides the per-option ones.

Every engine and server option has a variable of its own, ``TOKENLOOM_<NAME>`` for ``--name``
(`tokenloom.config.env_default`); those are found from the parsers. The variables below are read
directly where they matter. `ENV_VARS` is the one list of them: docs/configuration.md is generated
from it (`python -m tokenloom.entrypoints.config_doc`), and tests/unit/test_docs_configuration.py
fails when the code names a ``TOKENLOOM_`` variable that is neither an option's nor listed here.

This module imports nothing from tokenloom, so any layer may use it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str  # what applies when the variable is unset, in words
    meaning: str
    kind: str = "setting"  # setting | test | external (a variable of another tool that tokenloom also reads)


ENV_VARS: tuple[EnvVar, ...] = (
    # ---- settings
    EnvVar("TOKENLOOM_DEBUG", "off", "`1`: tracebacks instead of one-line errors, the engine process's included "
           "(the same as `--debug`); `serve --debug` sets it for the engine process"),
    EnvVar("TOKENLOOM_CACHE_DIR", "`~/.cache/tokenloom`", "where the weight cache (`weights/`) and the tokenizer "
           "cache (`tokenizers/`) live"),
    EnvVar("TOKENLOOM_WEIGHT_CACHE", "on", "`0`: no weight cache (GGUF files are parsed and repacked at every "
           "start)"),
    EnvVar("TOKENLOOM_WEIGHT_CACHE_MAX_GB", "2", "size bound of the weight cache in GiB; least recently used "
           "entries go first"),
    EnvVar("TOKENLOOM_KERNELS", "on", "`off` (or `0`, `false`, `no`): the torch path instead of the native "
           "kernels"),
    EnvVar("TOKENLOOM_KERNEL_CACHE", "`~/.cache/tokenloom/kernels`", "where native kernel builds are cached "
           "(one folder per ISA, torch version and source hash)"),
    EnvVar("TOKENLOOM_KERNEL_ISA", "the best the CPU has", "`avx2` or `avx512`: which build of the native "
           "kernels to load (e.g. the AVX2 build on an AVX512 CPU)"),
    EnvVar("TOKENLOOM_HUGE_PAGES", "on", "`off` (or `0`, `false`, `no`): quantized weights stay on ordinary "
           "pages instead of moving to transparent huge pages"),
    EnvVar("TOKENLOOM_LOG_LEVEL", "`INFO`", "log level of the engine and worker processes; `serve` sets it from "
           "`--log-level` (whose own variable it also is)"),
    EnvVar("TOKENLOOM_METRICS_PREFIX", "`tokenloom`", "prefix of the Prometheus series; `serve` sets it from "
           "`--metrics-prefix` (whose own variable it also is)"),
    # ---- tests
    EnvVar("TOKENLOOM_FAULTS", "off", "fault injection for the reliability tests only: "
           "`step_error=ID,step_hang=ID` makes a step raise or hang when it holds a request whose prompt starts "
           "with token id `ID`", kind="test"),
    EnvVar("TOKENLOOM_TEST_CACHE_DIR", "a fresh folder per run", "tests: reuse this cache folder (built "
           "tokenizers, converted weights) instead of one created and removed per run", kind="test"),
    EnvVar("TOKENLOOM_UI_ARTIFACTS", "`test-artifacts/ui/`", "tests: where the browser tests write their "
           "screenshots", kind="test"),
    # ---- other tools' variables
    EnvVar("OMP_NUM_THREADS", "one thread per core", "compute threads of the engine and worker processes "
           "(`--threads` sets it for the processes it starts)", kind="external"),
    EnvVar("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "off", "vLLM's: `True` (or `1`) opens `POST /v1/load_lora_adapter` and "
           "`/v1/unload_lora_adapter`, as `--allow-runtime-lora-updating` does", kind="external"),
    EnvVar("MASTER_ADDR", "`127.0.0.1`", "torchrun's: default of `--master-addr`", kind="external"),
    EnvVar("MASTER_PORT", "a free port (29500 on several nodes)", "torchrun's: default of `--master-port`",
           kind="external"),
    EnvVar("NNODES", "1", "torchrun's: default of `--nnodes`", kind="external"),
    EnvVar("NODE_RANK", "`GROUP_RANK`, else 0", "torchrun's: default of `--node-rank`", kind="external"),
    EnvVar("GROUP_RANK", "0", "torchrun's: default of `--node-rank` when `NODE_RANK` is unset", kind="external"),
    EnvVar("OPENAI_API_KEY", "none", "`tokenloom bench serve`: default of `--api-key`", kind="external"),
    EnvVar("VLLM_SERVER_DEV_MODE", "off", "vLLM's: `1` opens the weight-update, pause and sleep endpoints (as "
           "`--enable-weight-updates --enable-sleep-mode`)", kind="external"),
    EnvVar("MAX_JOBS", "min(4, cores)", "parallel compile jobs of the native kernel build (read by "
           "`torch.utils.cpp_extension`; set when unset)", kind="external"),
    EnvVar("CXX", "`c++`", "the C++ compiler of the native kernel build (read by `torch.utils.cpp_extension`); "
           "the test suite expects the kernels wherever it names a compiler", kind="external"),
)

BY_NAME: dict[str, EnvVar] = {v.name: v for v in ENV_VARS}


def is_true(raw: str) -> bool:
    """How every boolean variable reads: 1, true, yes or on (any case) is true."""
    return raw.strip().lower() in ("1", "true", "yes", "on")


def env_flag(name: str) -> bool:
    return is_true(os.environ.get(name, ""))


def vllm_dev_mode() -> bool:
    """vLLM's VLLM_SERVER_DEV_MODE=1: the development endpoints are open."""
    return env_flag("VLLM_SERVER_DEV_MODE")

