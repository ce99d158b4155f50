"""docs/configuration.md is generated from the code (`python -m tokenloom.entrypoints.config_doc --write`):
it must match what the generator makes now, and every environment variable the code reads must be
listed, either as an option's TOKENLOOM_<NAME> or in tokenloom/env_vars.py."""
from __future__ import annotations

import re
from pathlib import Path

from tokenloom import env_vars
from tokenloom.entrypoints import config_doc

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("tokenloom", "scripts", "tests")
# Read by the code but no setting of tokenloom's.
OS_BASICS = {"PATH", "HOME"}


def _sources():
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".sh") and path.is_file():
                yield path, path.read_text(errors="replace")


def test_configuration_page_matches_the_code():
    expected = config_doc.render()
    actual = (ROOT / "docs" / "configuration.md").read_text()
    assert actual == expected, ("docs/configuration.md is stale: run "
                                "`python -m tokenloom.entrypoints.config_doc --write` and commit it")


def test_every_tokenloom_variable_in_the_code_is_registered():
    known = set(env_vars.BY_NAME) | config_doc.option_variables()
    named: dict[str, str] = {}
    for path, text in _sources():
        for name in re.findall(r"TOKENLOOM_[A-Z][A-Z0-9_]*[A-Z0-9]", text):
            named.setdefault(name, str(path.relative_to(ROOT)))
    named.pop("TOKENLOOM_NAME", None)  # the pattern itself, TOKENLOOM_<NAME>, in prose
    missing = {name: where for name, where in named.items() if name not in known}
    assert not missing, f"add these to tokenloom/env_vars.py (or make them options): {missing}"


def test_every_environment_read_is_registered():
    """os.environ.get("X"), os.environ["X"], os.getenv("X") and environ.setdefault("X") name a listed variable."""
    known = set(env_vars.BY_NAME) | config_doc.option_variables() | OS_BASICS
    pattern = re.compile(r"""(?:environ\.get|environ\.setdefault|getenv|environ)\(?\[?\s*"""
                         r"""["']([A-Z][A-Z0-9_]*[A-Z0-9])["']""")
    missing = {}
    for path, text in _sources():
        if not str(path.relative_to(ROOT)).startswith("tokenloom"):
            continue
        for name in pattern.findall(text):
            if name not in known:
                missing.setdefault(name, str(path.relative_to(ROOT)))
    assert not missing, f"add these to tokenloom/env_vars.py: {missing}"


def test_registry_entries_are_read_somewhere():
    """No stale entries: every listed variable still appears in the code, scripts or tests."""
    text = "\n".join(t for p, t in _sources() if p.name != "env_vars.py")
    torchrun = {"MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "GROUP_RANK"}
    stale = [v.name for v in env_vars.ENV_VARS if v.name not in text and v.name not in torchrun]
    assert not stale, stale

