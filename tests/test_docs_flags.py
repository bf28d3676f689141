"""The documentation's flag reference (docs/hooks/flags.py, expanded into docs/server-flags.md and
docs/cli.md at build time) lists every flag the command's `--help` prints, so the docs cannot
drift from the parser."""

import argparse
import importlib.util
import re
from dataclasses import fields
from pathlib import Path

import pytest

from kestrel.cli import build_parser
from kestrel.config import SECTIONS, default_of

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ["serve", "run", "generate", "bench", "inspect"]


def load_hook():
    spec = importlib.util.spec_from_file_location(
        "docs_flags", ROOT / "docs" / "hooks" / "flags.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hook():
    return load_hook()


def cli_flags(command: str) -> list[str]:
    """Every option string of `kestrel COMMAND`, built the way `kestrel` builds its parser."""
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [name for action in sub.choices[command]._actions for name in action.option_strings]


def missing(reference: str, flags: list[str]) -> list[str]:
    return [flag for flag in flags if f"`{flag}`" not in reference]


@pytest.mark.parametrize("command", COMMANDS)
def test_reference_lists_every_flag(hook, command):
    flags = cli_flags(command)
    assert len(flags) > 3
    assert missing(hook.flag_reference(command), flags) == []


def help_flags(command: str) -> list[str]:
    """The flags `kestrel COMMAND --help` prints in its option lists (lines like
    `  -m MODEL, --model MODEL`), read from the help text itself."""
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    flags = []
    for line in sub.choices[command].format_help().splitlines():
        if re.match(r"^  {1,4}-", line):
            head = re.split(r"\s{2,}", line.strip())[0]
            flags += [part.split()[0] for part in head.split(", ")]
    return flags


def test_serve_reference_covers_what_serve_help_prints(hook):
    printed = help_flags("serve")
    assert sorted(printed) == sorted(cli_flags("serve"))  # the two ways agree
    for flag in ["--port", "-np", "--speculative", "-tp", "--gpu-memory-utilization", "--no-slots"]:
        assert flag in printed
    reference = hook.flag_reference("serve")
    assert missing(reference, printed) == []
    for heading in ["#### General", "#### Speculative decoding", "#### Parallel", "#### CUDA"]:
        assert heading in reference
    assert "`LLAMA_ARG_PORT`" in reference and "`LLAMA_API_KEY`" in reference


def test_a_skipped_group_is_caught(hook, monkeypatch):
    """The check is real: a generator that drops a group (here `parallel`) misses its flags."""
    real = hook.subparsers

    def without_parallel():
        parsers = real()
        serve = parsers["serve"]
        serve._action_groups = [g for g in serve._action_groups if g.title != "parallel"]
        return parsers

    monkeypatch.setattr(hook, "subparsers", without_parallel)
    lost = missing(hook.flag_reference("serve"), cli_flags("serve"))
    assert "--tensor-parallel-size" in lost and "-pp" in lost


def test_env_does_not_change_the_documented_defaults(hook, monkeypatch):
    monkeypatch.setenv("LLAMA_ARG_PORT", "9999")
    reference = hook.flag_reference("serve")
    assert "| `8080` |" in reference and "9999" not in reference


def test_marker_expands_in_pages(hook):
    page = "# Flags\n\n<!-- kestrel-flags: serve -->\n\nAfter.\n"
    out = hook.on_page_markdown(page, page=None, config=None, files=None)
    assert "kestrel-flags" not in out and "`--port`" in out and out.endswith("After.\n")
    for name in ["server-flags.md", "cli.md"]:
        assert "<!-- kestrel-flags: " in (ROOT / "docs" / name).read_text()


# flags whose default differs from the setting's on purpose: 0 or "" spell "off" on the command
# line (config.ZERO_IS_NONE, an empty origin list), and flags left unset let config decide
UNSET = (None, 0, "")
# a benchmark's own defaults: throughput runs 256 sequences at once, as vLLM's benchmark does
OWN_DEFAULTS = {"bench": {"max_num_seqs"}}


@pytest.mark.parametrize("command", COMMANDS)
def test_a_flag_defaults_to_its_settings_default(command):
    """A flag that sets a config field takes its default from config.py, where it is written once:
    changing it there changes every command's flag."""
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    names = {f.name for section in SECTIONS.values() for f in fields(section)}
    different = [
        f"{action.option_strings[0]}: {action.default!r}, config: {default_of(action.dest)!r}"
        for action in sub.choices[command]._actions
        if action.dest in names
        and action.default != default_of(action.dest)
        and action.default not in UNSET
        and action.dest not in OWN_DEFAULTS.get(command, ())
    ]
    assert different == []
