"""Set-up is quiet and idempotent, and the package metadata builds without the license warning."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_license_is_an_spdx_string():
    """The table form (license = {text = ...}) makes setuptools >= 77 warn on every install."""
    tomllib = pytest.importorskip("tomllib", reason="platform: Python 3.10 has no tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert not any(c.startswith("License ::") for c in project.get("classifiers", []))


@pytest.mark.skipif(not (ROOT / ".venv" / ".setup-test").exists(), reason="venv: not made by setup.sh test")
def test_setup_with_nothing_changed_is_a_silent_no_op():
    start = time.monotonic()
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "test"], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == "", (proc.stdout, proc.stderr)
    assert time.monotonic() - start < 5
