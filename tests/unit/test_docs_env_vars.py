"""README's "Environment variables" section names every TOKENLOOM_* variable the code reads: the one
per option (recorded as the parsers are built) and the ones read directly."""
from __future__ import annotations

import re
from pathlib import Path

import tokenloom.config as config
import tokenloom.entrypoints.compat as compat

ROOT = Path(__file__).resolve().parents[2]


def _readme_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Environment variables")
    return text[start:text.index("\n## ", start + 1)]


def test_every_option_variable_is_listed(monkeypatch):
    names: list[str] = []
    real = config.env_default

    def recording(name, default, kind=str):
        names.append(name)
        return real(name, default, kind)

    monkeypatch.setattr(config, "env_default", recording)
    monkeypatch.setattr(compat, "env_default", recording)
    from tokenloom.entrypoints.cli import build_parser
    build_parser(None)
    section = _readme_section()
    assert len(names) > 30
    missing = sorted({f"TOKENLOOM_{n.upper()}" for n in names} - set(re.findall(r"TOKENLOOM_[A-Z_]+", section)))
    assert not missing, missing


def test_every_variable_read_in_the_code_is_listed():
    used = set()
    for path in (ROOT / "tokenloom").rglob("*.py"):
        used |= set(re.findall(r"TOKENLOOM_[A-Z][A-Z_]*[A-Z]", path.read_text()))
    used -= {"TOKENLOOM_NAME"}  # the pattern in docstrings, TOKENLOOM_<NAME>
    missing = sorted(used - set(re.findall(r"TOKENLOOM_[A-Z_]+", _readme_section())))
    assert not missing, missing
