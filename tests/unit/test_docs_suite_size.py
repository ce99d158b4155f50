"""What README.md and docs/testing.md say about the suite, checked against the suite: its size ("about N
tests"), that `make test` runs all of it, and which files `make test-fallback` reruns on the torch path."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import helpers
import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "docs" / "testing.md"]
# "About N" is a round figure (to 50) of a suite that grows by tens of tests a week: 5 % is ~3 weeks' growth.
SIZE_TOLERANCE = 0.05


def _collected(config: pytest.Config) -> int:
    """The suite's size: what this session collected when it collected the whole suite, else a collection of
    its own."""
    if helpers.WHOLE_SUITE_COUNT in config.stash:
        return config.stash[helpers.WHOLE_SUITE_COUNT]
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    found = re.search(r"^(\d+) tests? collected", proc.stdout, re.M)
    assert proc.returncode == 0 and found, proc.stdout[-3000:] + proc.stderr[-3000:]
    return int(found.group(1))


def _recipe(target: str) -> list[str]:
    """The command lines of a Makefile target."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def _kernel_sensitive() -> list[str]:
    """The Makefile's KERNEL_SENSITIVE entries, a `$(wildcard ...)` given as its pattern."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    value = re.search(r"^KERNEL_SENSITIVE \?=(.*)$", text, re.M).group(1)
    return re.sub(r"\$\(wildcard ([^)]*)\)", r"\1", value).split()


def test_the_stated_suite_size_is_the_collected_count(pytestconfig):
    count = _collected(pytestconfig)
    for page in PAGES:
        stated = [int(n.replace(",", "")) for n in re.findall(r"about ([\d,]+) tests", page.read_text())]
        assert stated, f"{page.name} states no suite size"
        for n in stated:
            assert abs(n - count) <= SIZE_TOLERANCE * count, f"{page.name} says about {n} tests; {count} collected"


def test_make_test_runs_the_whole_suite():
    """No path, marker, keyword or ignore narrows `make test`: the README's "the whole suite"."""
    (command,) = [line for line in _recipe("test") if "pytest" in line]
    args = command.split("pytest", 1)[1].split()
    assert args[-1] == "$(ARGS)" and all(a.startswith("-") for a in args[:-1]), command
    assert not {"-m", "-k", "--ignore", "--deselect"} & set(args), command
    assert "-rs" in args  # skip reasons printed


def test_the_fallback_files_are_the_documented_ones():
    page = (ROOT / "docs" / "testing.md").read_text()
    fallback = page.split("**Fallback.**", 1)[1].split("\n- ", 1)[0]
    documented = re.findall(r"`(tests/[^`]+\.py)`", fallback)
    assert sorted(documented) == sorted(_kernel_sensitive())
