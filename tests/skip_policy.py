"""The suite's skip policy: a test may skip only for a reason on one short list, so a run cannot pass with a
path left untested for a reason nobody chose.

Every allowed skip reason starts with its tag ("gpu: no CUDA device"). A skip whose reason starts with no tag
of `ALLOWED_SKIPS` fails the session; the summary names each such test. The native kernels are one case:
on a machine that can build them (a CPU with AVX2 or AVX512, a C++ compiler) and where
`TOKENLOOM_KERNELS=off` was not asked, a session whose kernels did not load stops before any test runs.
docs/testing.md ("Skips") lists the same tags.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tokenloom import kernels

ALLOWED_SKIPS: dict[str, str] = {
    "gpu": "no CUDA device (or a CUDA-only package missing, or a test that needs a machine without one)",
    "slow": "marked slow: runs with --run-slow (make soak)",
    "kernels": "native kernels off by request (TOKENLOOM_KERNELS=off), or a CPU or toolchain that cannot "
               "build them (no AVX2, no C++ compiler)",
    "huge pages": "transparent huge pages are off on this machine",
    "browser": "no chromium on PATH (scripts/setup.sh installs it when run as root)",
    "platform": "not Linux, or a Python without a module the test reads (tomllib before 3.11)",
    "venv": "not run from the .venv that scripts/setup.sh made (the set-up script's own test)",
}


def allowed(reason: str) -> bool:
    return any(reason.startswith(f"{tag}: ") for tag in ALLOWED_SKIPS)


def kernels_problem() -> str | None:
    """Why this session must not run: the kernels should have loaded and did not (None when all is well)."""
    status = kernels.status()
    if status.loaded or not status.expected:
        return None
    return (f"the native kernels did not load ({status.reason}) on a machine that can build them "
            f"(AVX2/AVX512 CPU, compiler {kernels.compiler()}). See `python -m tokenloom.kernels.build -v`, "
            "or run with TOKENLOOM_KERNELS=off to test the torch path alone.")


def require_kernels() -> None:
    """In a test that needs the native kernels: skip (allowed) when they are off by request or cannot be
    built here; fail when they should have loaded."""
    status = kernels.status()
    if status.loaded:
        return
    if status.expected:
        pytest.fail(f"native kernels expected but not loaded: {status.reason}")
    pytest.skip(f"kernels: {status.reason}")


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


@dataclass(eq=False)  # hashable by identity, as pytest's plugin manager needs
class SkipBudget:
    """Collects every skip of the session and fails the session on one outside `ALLOWED_SKIPS`."""

    unlisted: list[tuple[str, str]] = field(default_factory=list)

    def note(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = _skip_reason(report)
            if not allowed(reason):
                self.unlisted.append((report.nodeid, reason))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.note(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self.note(report)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.unlisted and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        terminalreporter.write_line(f"tokenloom: native kernels {kernels.status().describe()}")
        if self.unlisted:
            terminalreporter.section("skips outside the allow-list (tests/skip_policy.py)", red=True)
            for nodeid, reason in self.unlisted:
                terminalreporter.write_line(f"{nodeid}: {reason}")
