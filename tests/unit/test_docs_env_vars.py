"""docs/configuration.md's "Environment variables" section names every TOKENLOOM_* variable the code
reads: the one per option (recorded as the parsers are built) and the ones read directly."""
from __future__ import annotations

import re
from pathlib import Path

import tokenloom.config as config
import tokenloom.entrypoints.compat as compat

ROOT = Path(__file__).resolve().parents[2]


def _env_section() -> str:
    text = (ROOT / "docs" / "configuration.md").read_text()
    start = text.index("## Environment variables")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


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
    section = _env_section()
    assert len(names) > 30
    missing = sorted({f"TOKENLOOM_{n.upper()}" for n in names} - set(re.findall(r"TOKENLOOM_[A-Z_]+", section)))
    assert not missing, missing


def test_every_variable_read_in_the_code_is_listed():
    used = set()
    for path in (ROOT / "tokenloom").rglob("*.py"):
        used |= set(re.findall(r"TOKENLOOM_[A-Z][A-Z_]*[A-Z]", path.read_text()))
    used -= {"TOKENLOOM_NAME"}  # the pattern in docstrings, TOKENLOOM_<NAME>
    missing = sorted(used - set(re.findall(r"TOKENLOOM_[A-Z_]+", _env_section())))
    assert not missing, missing


def test_docs_link_to_the_configuration_page():
    """The README sends readers to the generated page rather than keeping a copy of its tables."""
    readme = (ROOT / "README.md").read_text()
    assert "docs/configuration.md" in readme
    assert "| `TOKENLOOM_DTYPE` |" not in readme
