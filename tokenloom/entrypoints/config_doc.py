"""docs/configuration.md, generated from the command-line parsers and `tokenloom.env_vars`.

    python -m tokenloom.entrypoints.config_doc > docs/configuration.md
    python -m tokenloom.entrypoints.config_doc --write          # the same, into the repository's docs/
    python -m tokenloom.entrypoints.config_doc --check          # exit 1 when docs/configuration.md is stale

Every flag of every `tokenloom` subcommand comes from `build_parser()`; which flags have a
``TOKENLOOM_<NAME>`` variable is recorded while the parsers are built (`config.env_default` is called
for exactly those); the engine options' defaults come from the config dataclasses. The parsers are
built with tokenloom's and torchrun's variables unset, so the page shows the built-in defaults, not
this shell's. tests/unit/test_docs_configuration.py fails when the page drifts from the code.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from tokenloom import config
from tokenloom.entrypoints.cli import build_parser
from tokenloom.env_vars import ENV_VARS

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
# Variables that change what the parsers show as defaults: unset while they are built.
_TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "GROUP_RANK")


@dataclasses.dataclass
class _Option:
    flags: str  # "-tp, --tensor-parallel-size" or "MODEL (positional)"
    variables: list[str]
    default: str
    meaning: str


@dataclasses.dataclass
class _Group:
    title: str
    options: list[_Option]

    def key(self) -> tuple:
        return self.title, tuple(o.flags for o in self.options)


@dataclasses.dataclass
class _Command:
    name: str  # "serve", "bench throughput"
    help: str
    groups: list[_Group]
    refused: dict[str, str]  # flag -> reason


@contextlib.contextmanager
def _recording() -> Iterator[dict[int, list[str]]]:
    """Record, per argparse action, the TOKENLOOM_<NAME> names asked for while its add_argument call was
    being prepared (env_default is evaluated in that call's arguments), with those variables unset."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("TOKENLOOM_") or k in _TORCHRUN_VARS}
    for k in saved:
        del os.environ[k]
    pending: list[str] = []
    by_action: dict[int, list[str]] = {}
    real_add = argparse._ActionsContainer.add_argument  # noqa: SLF001 - the one place every flag goes through

    def add_argument(self, *args, **kwargs):
        names = list(pending)
        pending.clear()
        action = real_add(self, *args, **kwargs)
        if names:
            by_action[id(action)] = names
        return action

    try:
        config.env_lookup_listener = pending.append
        argparse._ActionsContainer.add_argument = add_argument  # noqa: SLF001
        yield by_action
    finally:
        argparse._ActionsContainer.add_argument = real_add  # noqa: SLF001
        config.env_lookup_listener = None
        os.environ.update(saved)


def _dataclass_defaults() -> dict[str, object]:
    """Engine option name -> its default, from the config dataclasses (factories run with the variables
    they read unset: the caller holds _recording)."""
    out: dict[str, object] = {}
    for cls in (config.ModelConfig, config.CacheConfig, config.SchedulerConfig, config.ParallelConfig,
                config.LimitsConfig, config.MultiModalConfig, config.EngineConfig):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out.setdefault(f.name, f.default)
            elif f.default_factory is not dataclasses.MISSING and not dataclasses.is_dataclass(f.type):
                value = f.default_factory()
                if not dataclasses.is_dataclass(value):
                    out.setdefault(f.name, value)
    return out


def _show(value: object) -> str:
    if value is None or value == "" or value is argparse.SUPPRESS:
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, (list, tuple, dict)):
        return f"`{json.dumps(value)}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _meaning(action: argparse.Action, parser: argparse.ArgumentParser) -> str:
    text = action.help or ""
    try:
        text = text % {"default": action.default, "prog": parser.prog}
    except (KeyError, TypeError, ValueError):
        text = text.replace("%%", "%")
    if action.choices and not isinstance(action.choices, dict):
        choices = [str(c) for c in action.choices]
        if not all(c in text for c in choices):
            text = (text + "; " if text else "") + "one of " + ", ".join(f"`{c}`" for c in choices)
    return text


def _option(action: argparse.Action, parser: argparse.ArgumentParser, variables: list[str],
            engine_defaults: dict[str, object]) -> _Option:
    if action.option_strings:
        flags = ", ".join(f"`{s}`" for s in action.option_strings)
    else:
        flags = f"`{(action.metavar or action.dest).upper()}` (positional)"
    takes_no_value = action.nargs == 0
    default = action.default
    if default is None and variables and action.dest in engine_defaults:  # an engine option
        default = engine_defaults[action.dest]
    if takes_no_value:
        shown = ""  # a switch: off unless given
    else:
        shown = _show(default)
    return _Option(flags, variables, shown, _meaning(action, parser))


def _commands() -> list[_Command]:
    with _recording() as by_action:
        root = build_parser(None)
        engine_defaults = _dataclass_defaults()
    commands: list[_Command] = []

    def visit(parser: argparse.ArgumentParser, name: str, help_text: str) -> None:
        groups: list[_Group] = []
        refused: dict[str, str] = {}
        subparsers = None
        for group in parser._action_groups:  # noqa: SLF001
            title = "options" if group.title in ("optional arguments", "options") else group.title
            options = []
            for action in group._group_actions:  # noqa: SLF001
                if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
                    subparsers = action
                    continue
                if isinstance(action, argparse._HelpAction):  # noqa: SLF001
                    continue
                if action.help == argparse.SUPPRESS:
                    reason = getattr(action, "reason", None)
                    if reason:
                        refused[", ".join(action.option_strings)] = reason
                    continue
                options.append(_option(action, parser, by_action.get(id(action), []), engine_defaults))
            if options:
                groups.append(_Group(title, options))
        if subparsers is None or not name:
            commands.append(_Command(name, help_text, groups, refused))
        if subparsers is not None:
            helps = {a.dest: a.help or "" for a in subparsers._choices_actions}  # noqa: SLF001
            for sub_name, sub in subparsers.choices.items():
                visit(sub, f"{name} {sub_name}".strip(), helps.get(sub_name, ""))

    visit(root, "", root.description or "")
    return commands


def _anchor(title: str) -> str:
    keep = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return keep.strip().replace(" ", "-")


def _title(title: str) -> str:
    """"engine" -> "Engine"; "vLLM server flags" and "CORS (as vLLM)" stay as they are."""
    return title[0].upper() + title[1:] if title[:2].islower() else title


def _table(options: list[_Option], out: list[str]) -> None:
    out.append("| Flag | Variable | Default | Meaning |")
    out.append("| --- | --- | --- | --- |")
    for o in options:
        variables = ", ".join(f"`{v}`" for v in o.variables)
        out.append(f"| {o.flags} | {variables} | {_cell(o.default)} | {_cell(o.meaning)} |")
    out.append("")


def render() -> str:
    """The whole page."""
    commands = _commands()
    root = next(c for c in commands if c.name == "")
    subcommands = [c for c in commands if c.name]

    # Option groups that several commands share (the engine's, the compatibility spellings) are shown once.
    seen: dict[tuple, list[str]] = {}
    for c in subcommands:
        for g in c.groups:
            seen.setdefault(g.key(), []).append(c.name)
    shared = {k: names for k, names in seen.items() if len(names) > 1}

    out = ["# Configuration", "",
           "<!-- Generated by `python -m tokenloom.entrypoints.config_doc --write` from the command-line parsers "
           "and tokenloom/env_vars.py; do not edit by hand. -->", "",
           "Every flag of every `tokenloom` command, and every environment variable tokenloom reads. "
           "`tokenloom COMMAND --help` prints the same flags.", "",
           "An option with a variable in the table can also be set as that variable, `TOKENLOOM_<NAME>` for "
           "`--name`; a flag on the command line wins. A switch's variable is on for `1`, `true`, `yes` or `on`. "
           "An empty default means none (the meaning says what applies then).", "",
           "## Commands", "",
           "| Command | What it does |", "| --- | --- |"]
    for c in subcommands:
        out.append(f"| [`tokenloom {c.name}`](#{_anchor('tokenloom ' + c.name)}) | {_cell(c.help)} |")
    out.append("")
    if root.groups:
        out += ["Options of `tokenloom` itself:", ""]
        for g in root.groups:
            _table(g.options, out)

    if shared:
        out += ["## Shared option groups", ""]
        for (title, _), names in shared.items():
            group = next(g for c in subcommands for g in c.groups if g.key() == (title, _))
            users = ", ".join(f"`{n}`" for n in names)
            out += [f"### {_title(title)} options", "", f"Taken by {users}.", ""]
            _table(group.options, out)

    refused_all: dict[tuple[str, str], list[str]] = {}
    for c in subcommands:
        out += [f"## `tokenloom {c.name}`", ""]
        if c.help:
            out += [c.help[0].upper() + c.help[1:] + ("" if c.help.endswith(".") else "."), ""]
        also = [g.title for g in c.groups if g.key() in shared]
        for g in c.groups:
            if g.key() in shared:
                continue
            if len(c.groups) > 1 or also:
                out += [f"{_title(g.title)}:", ""]
            _table(g.options, out)
        if also:
            links = ", ".join(f"[{t}](#{_anchor(t + ' options')})" for t in also)
            out += [f"Also the shared {links} options.", ""]
        for flag, reason in c.refused.items():
            refused_all.setdefault((flag, reason), []).append(c.name)

    if refused_all:
        out += ["## Refused flags", "",
                "Flags of vLLM and llama.cpp for features tokenloom lacks: each ends the command with one line "
                "naming the flag and the reason, so nothing is silently ignored.", "",
                "| Flag | Commands | Why |", "| --- | --- | --- |"]
        for (flag, reason), names in refused_all.items():
            flags = ", ".join(f"`{f}`" for f in flag.split(", "))
            out.append(f"| {flags} | {', '.join(f'`{n}`' for n in names)} | {_cell(reason)} |")
        out.append("")

    # ---- environment variables
    per_variable: dict[str, tuple[str, list[str]]] = {}
    for c in subcommands:
        for g in c.groups:
            for o in g.options:
                for v in o.variables:
                    flags, names = per_variable.setdefault(v, (o.flags, []))
                    if c.name not in names:
                        names.append(c.name)
    out += ["## Environment variables", "",
            "### One per option", "",
            "| Variable | Flag | Commands |", "| --- | --- | --- |"]
    for v in sorted(per_variable):
        flags, names = per_variable[v]
        out.append(f"| `{v}` | {flags} | {', '.join(f'`{n}`' for n in names)} |")
    out.append("")
    titles = {"setting": "### Read directly", "test": "### For the tests",
              "external": "### Other tools' variables that tokenloom reads"}
    for kind, title in titles.items():
        rows = [v for v in ENV_VARS if v.kind == kind]
        out += [title, "", "| Variable | When unset | Meaning |", "| --- | --- | --- |"]
        for v in rows:
            out.append(f"| `{v.name}` | {_cell(v.default)} | {_cell(v.meaning)} |")
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def option_variables() -> set[str]:
    """Every TOKENLOOM_<NAME> that some command's option reads."""
    return {v for c in _commands() for g in c.groups for o in g.options for v in o.variables}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenloom.entrypoints.config_doc",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write {DOC_PATH}")
    parser.add_argument("--check", action="store_true", help=f"exit 1 when {DOC_PATH} differs from the code")
    ns = parser.parse_args(argv)
    text = render()
    if ns.check:
        if not DOC_PATH.exists() or DOC_PATH.read_text() != text:
            print(f"{DOC_PATH} is stale: run python -m tokenloom.entrypoints.config_doc --write", file=sys.stderr)
            return 1
        return 0
    if ns.write:
        DOC_PATH.write_text(text)
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
