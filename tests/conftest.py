"""Session-scoped fixtures shared by the unit and e2e tests (loading a model costs seconds, so each is
loaded once per session). This folder is on sys.path, so tests can ``import helpers``."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import helpers
import pytest
import skip_policy
import torch

from tokenloom import kernels

# Test runs use their own cache directory (built tokenizers, converted weights): never the user's
# ~/.cache/tokenloom, and never a stale entry from an earlier run. Servers the tests start inherit it.
# TOKENLOOM_TEST_CACHE_DIR names a directory to reuse across runs instead.
_TEST_CACHE = os.environ.get("TOKENLOOM_TEST_CACHE_DIR") or tempfile.mkdtemp(prefix="tokenloom-test-cache-")
os.environ["TOKENLOOM_CACHE_DIR"] = _TEST_CACHE


def pytest_sessionfinish(session, exitstatus):
    if not os.environ.get("TOKENLOOM_TEST_CACHE_DIR"):
        shutil.rmtree(_TEST_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def embedded_path() -> str:
    from tokenloom.model.model_path import embedded_model_path
    return embedded_model_path()


@pytest.fixture(scope="session")
def embedded_loaded(embedded_path):
    """Our engine's load of the embedded model (float32, CPU)."""
    from tokenloom.model.loader import load_model
    return load_model(embedded_path, torch.float32, torch.device("cpu"), progress=False)


@pytest.fixture(scope="session")
def hf_embedded(embedded_path):
    """transformers' load of the same GGUF file (float32)."""
    return helpers.load_hf_from_gguf(embedded_path)


def _matmul_key(matmul_dtype, dtype) -> str:
    """build_engine casts (and prepacks) the shared model in place for a matmul dtype other than the
    activations': such engines must not share weights with the others."""
    if matmul_dtype in (None, "auto") or f"torch.{matmul_dtype}" == str(dtype):
        return "same"
    return str(matmul_dtype)


@contextlib.contextmanager
def _reuse_loaded(loaded_by_path: dict, matmul_dtype=None):
    """Make build_engine reuse already loaded weights for known (path, dtype, device, matmul dtype)
    (loading is deterministic)."""
    import tokenloom.worker.phases as phases
    from tokenloom.model.model_path import resolve_model_path
    real = phases.load_model

    def load(model, dtype, device, progress=True, attention=None, tensors=None, mmproj=None):
        if tensors is not None or mmproj is not None:  # a weight update's own tensors, an mmproj pair: not shared
            return real(model, dtype, device, progress=progress, attention=attention, tensors=tensors,
                        mmproj=mmproj)
        # The layers' impls are the backend's: engines on different backends load apart.
        key = (resolve_model_path(model), dtype, torch.device(device), _matmul_key(matmul_dtype, dtype),
               attention.name if attention is not None else None)
        if key not in loaded_by_path:
            loaded_by_path[key] = real(model, dtype, device, progress=progress, attention=attention)
        return loaded_by_path[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(phases, "load_model", load)
        yield


@pytest.fixture(scope="session")
def make_llm(embedded_path, embedded_loaded):
    """``make_llm(**engine_args)``: an LLM on the embedded model that shares one loaded copy of the weights
    (each LLM still has its own KV cache, scheduler and config)."""
    from tokenloom import LLM
    from tokenloom.model.layers.attention_select import choose_attention_backend
    cpu = torch.device("cpu")
    # embedded_loaded's impls are the automatic CPU backend's, as an engine on the defaults chooses.
    loaded = {(embedded_path, torch.float32, cpu, "same", choose_attention_backend("auto", cpu)): embedded_loaded}

    def make(**engine_args):
        engine_args.setdefault("dtype", "float32")
        engine_args.setdefault("device", "cpu")
        engine_args.setdefault("log_stats_interval", 0)
        with _reuse_loaded(loaded, engine_args.get("matmul_dtype")):
            return LLM(progress=False, **engine_args)

    return make


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """``tiny_models(kind) -> (folder, hf_model)``: a tiny random transformers model saved as a HF folder,
    built once per session (kinds: helpers.TINY_VARIANTS)."""
    built: dict[str, tuple[str, torch.nn.Module]] = {}

    def get(kind: str):
        if kind not in built:
            model = helpers.build_tiny_model(kind)
            folder = helpers.save_tiny_model(model, str(tmp_path_factory.mktemp(f"tiny_{kind}")))
            built[kind] = (folder, model)
        return built[kind]

    return get


@pytest.fixture(scope="session")
def make_core(tiny_models):
    """``make_core(kind="llama", **engine_args)``: an EngineCore on a tiny random model (weights loaded once
    per kind)."""
    from tokenloom.config import EngineConfig
    from tokenloom.engine.core import EngineCore
    loaded: dict = {}

    def make(kind: str = "llama", **engine_args):
        folder, _ = tiny_models(kind)
        engine_args.setdefault("dtype", "float32")
        engine_args.setdefault("device", "cpu")
        engine_args.setdefault("log_stats_interval", 0)
        if "num_blocks" not in engine_args:
            engine_args.setdefault("kv_cache_memory", 0.05)
        with _reuse_loaded(loaded, engine_args.get("matmul_dtype")):
            return EngineCore(EngineConfig.from_kwargs(model=folder, **engine_args), progress=False)

    return make


def pytest_configure(config):
    config.pluginmanager.register(skip_policy.SkipBudget(), "tokenloom-skip-budget")


def pytest_report_header(config):
    return f"tokenloom native kernels: {kernels.status().describe()}"


def pytest_sessionstart(session):
    """Stop before any test when the native kernels should have loaded and did not (tests/skip_policy.py)."""
    problem = skip_policy.kernels_problem()
    if problem:
        pytest.exit(problem, returncode=pytest.ExitCode.TESTS_FAILED)


def pytest_runtest_setup(item):
    if item.get_closest_marker("kernels"):
        skip_policy.require_kernels()


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run tests marked slow (the long soak: `make soak`)")


@pytest.hookimpl(tryfirst=True)  # before any plugin deselects: the count is the whole collection
def pytest_collection_modifyitems(config, items):
    # The collected count when this session gathered the whole suite (no path, keyword or marker given), so
    # the suite-size check reads it instead of collecting all of it again (~20 s) in a subprocess.
    if (config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.keyword
            and not config.option.markexpr and not config.option.deselect and not config.option.ignore):
        config.stash[helpers.WHOLE_SUITE_COUNT] = len(items)
    skip_gpu = pytest.mark.skip(reason="gpu: no CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: needs --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory):
    """(folder, hf_model): a tiny random LLaVA saved with its tokenizer, image processor and chat template."""
    folder = str(tmp_path_factory.mktemp("tiny_llava"))
    return folder, helpers.build_tiny_llava(folder)


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl(tmp_path_factory):
    """(folder, hf_model): a tiny random Qwen2.5-VL saved with its tokenizer, image processor and chat template."""
    folder = str(tmp_path_factory.mktemp("tiny_qwen2_5_vl"))
    return folder, helpers.build_tiny_qwen2_5_vl(folder)


@pytest.fixture(scope="session")
def tiny_gemma3_mm(tmp_path_factory):
    """(folder, hf_model): a tiny random Gemma 3 with images, saved with its tokenizer, image processor and chat
    template."""
    folder = str(tmp_path_factory.mktemp("tiny_gemma3_mm"))
    return folder, helpers.build_tiny_gemma3_mm(folder)
