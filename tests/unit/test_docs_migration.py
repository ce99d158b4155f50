"""What docs/migration.md and the README say about the engine is what the engine does: the flags the
migration tables call refused are the ones the CLI refuses, the flags they call working are ones the CLI
knows, and the GGUF memory figure is the loaded model's."""
from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

from tokenloom.entrypoints.cli import build_parser
from tokenloom.entrypoints.compat import UNSUPPORTED

REPO = Path(__file__).resolve().parents[2]
MIGRATION = (REPO / "docs" / "migration.md").read_text()
README = (REPO / "README.md").read_text()
REFUSED = {flag for flags in UNSUPPORTED for flag in flags}


def flag_rows(text: str) -> list[tuple[list[str], str]]:
    """(flags named in the first cell, the second cell) of every table row whose first cell names a flag."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))] if line.startswith("|") else []
        if len(cells) < 2:
            continue
        flags = [f for code in re.findall(r"`([^`]+)`", cells[0]) for f in re.findall(r"(?<![\w-])-{1,2}[\w*-]+", code)]
        if flags:
            rows.append((flags, cells[1]))
    return rows


def known_flags() -> set[str]:
    parser = build_parser()
    return {flag for command in ("serve", "generate") for flag in parser.subcommands[command]._option_string_actions}


def expand(flag: str, candidates: set[str]) -> set[str]:
    """`--rope-*` stands for every refused flag it matches."""
    return set(fnmatch.filter(candidates, flag)) if "*" in flag else {flag}


def test_the_refused_flags_in_the_migration_tables_are_the_ones_the_cli_refuses():
    documented = {f for flags, meaning in flag_rows(MIGRATION) if meaning.startswith("refused")
                  for flag in flags for f in expand(flag, REFUSED)}
    assert documented == REFUSED, (f"refused by the CLI, not in migration.md: {sorted(REFUSED - documented)}; "
                                   f"called refused, yet accepted: {sorted(documented - REFUSED)}")


def test_the_flags_the_migration_tables_call_working_are_known_and_not_refused():
    known = known_flags()
    working = {flag for flags, meaning in flag_rows(MIGRATION) if not meaning.startswith("refused")
               for flag in flags if "*" not in flag}
    assert working, "no flag rows found"
    assert sorted(working - known) == [], "migration.md says these work, the CLI does not know them"
    assert sorted(working & REFUSED) == [], "migration.md says these work, the CLI refuses them"


@pytest.mark.parametrize("text", [README, MIGRATION], ids=["README", "migration"])
def test_the_embedded_gguf_memory_figure_is_the_loaded_models(text, embedded_loaded):
    """On the CPU with the native kernels the embedded model's blocks stay quantized: its weights' memory,
    as the loader counts it, is the figure the docs give."""
    from tokenloom.model.layers.quantized_linear import quantized_weights
    if not quantized_weights(embedded_loaded.model):
        pytest.skip("the native kernels do not run here: the weights are dequantized")
    figure = re.search(r"embedded (?:Q4_1 )?model: (\d+) MiB", text)
    assert figure, "the memory figure is gone from the page"
    assert int(figure.group(1)) == round(embedded_loaded.bytes / 2 ** 20)
