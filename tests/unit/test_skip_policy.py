"""The suite's skip policy (tests/skip_policy.py): a skip outside the allow-list fails the session, and a
session on a machine that can build the native kernels stops when they did not load. Each session here is a
pytest of its own in a subprocess, so what is checked is its exit status and its output."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from skip_policy import ALLOWED_SKIPS, allowed

from tokenloom import kernels
from tokenloom.kernels import cpu_features

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
# One test of a module marked `kernels`, cheap once the kernels are loaded.
KERNEL_TEST = ["tests/unit/test_kernels_sampling.py", "-k", "test_argmax_schema_and_fake"]


def _pytest(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("TOKENLOOM_KERNELS", "TOKENLOOM_KERNEL_ISA")}
    environment["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT)])
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, timeout=600, cwd=cwd, env={**environment, **env})


def _session_with(tmp_path: Path, reason: str) -> subprocess.CompletedProcess:
    """A session of one passing test and one that skips for `reason`, under the suite's skip budget."""
    (tmp_path / "conftest.py").write_text(
        "import skip_policy\n\n\ndef pytest_configure(config):\n"
        "    config.pluginmanager.register(skip_policy.SkipBudget(), 'tokenloom-skip-budget')\n")
    (tmp_path / "test_one.py").write_text(
        f"import pytest\n\n\ndef test_passes():\n    pass\n\n\n"
        f"def test_skips():\n    pytest.skip({reason!r})\n")
    return _pytest([], tmp_path)


def test_a_reason_is_allowed_only_by_its_tag():
    assert allowed("gpu: no CUDA device") and allowed("slow: needs --run-slow")
    assert not allowed("could not import 'flashinfer'")
    assert not allowed("gpus: no CUDA device") and not allowed("no GPU here (gpu: )")


def test_a_skip_outside_the_allow_list_fails_the_session(tmp_path):
    proc = _session_with(tmp_path, "the fixture file is missing")
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, proc.stdout
    assert "skips outside the allow-list" in proc.stdout
    assert "test_one.py::test_skips: the fixture file is missing" in proc.stdout


def test_an_allowed_skip_passes_the_session_and_its_reason_is_printed(tmp_path):
    proc = _session_with(tmp_path, "gpu: no CUDA device")
    assert proc.returncode == pytest.ExitCode.OK, proc.stdout
    assert "SKIPPED [1] test_one.py:9: gpu: no CUDA device" in proc.stdout
    assert "skips outside the allow-list" not in proc.stdout


def test_every_allowed_tag_is_documented():
    page = (ROOT / "docs" / "testing.md").read_text()
    section = page.split("## Skips", 1)[1].split("\n## ", 1)[0]
    assert set(re.findall(r"^\| `([a-z ]+)` \|", section, re.M)) == set(ALLOWED_SKIPS)


@pytest.mark.skipif(not cpu_features.supported_isas() or kernels.compiler() is None,
                    reason="kernels: this machine cannot build the native kernels")
def test_a_failed_kernel_build_stops_the_session_before_any_test(tmp_path):
    """A compiler that fails every call and an empty kernel cache: the build fails, so the run fails."""
    proc = _pytest(KERNEL_TEST, ROOT, TOKENLOOM_KERNEL_CACHE=str(tmp_path), CXX="/bin/false")
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, proc.stdout + proc.stderr
    assert "the native kernels did not load" in proc.stdout + proc.stderr
    assert " passed" not in proc.stdout


def test_kernels_off_by_request_skip_the_kernel_tests_with_an_allowed_reason():
    proc = _pytest(KERNEL_TEST, ROOT, TOKENLOOM_KERNELS="off")
    assert proc.returncode == pytest.ExitCode.OK, proc.stdout + proc.stderr
    assert "kernels: off by request: TOKENLOOM_KERNELS=off" in proc.stdout
    assert "1 skipped" in proc.stdout


@pytest.mark.skipif(not cpu_features.supported_isas() or kernels.compiler() is None,
                    reason="kernels: this machine cannot build the native kernels")
def test_the_run_names_the_instruction_set_that_loaded(tmp_path):
    proc = _session_with(tmp_path, "gpu: no CUDA device")
    assert f"tokenloom: native kernels {cpu_features.best_isa()} build loaded" in proc.stdout
