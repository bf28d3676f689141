"""MkDocs hook: the command-line flag reference, generated from kestrel's own argparse parser at
build time, so the docs cannot drift from `kestrel <command> --help`.

A page asks for a command's reference with a line `<!-- kestrel-flags: serve -->` (any of the
subcommands `kestrel --help` lists); the hook replaces it with one table per argument group.
"""

import argparse
import contextlib
import os
import re
import sys
from pathlib import Path

# the tree being documented, not whichever kestrel happens to be installed
SRC = Path(__file__).resolve().parents[2] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

MARKER = re.compile(r"^<!-- kestrel-flags: ([a-z]+) -->$", re.M)


@contextlib.contextmanager
def _without_llama_env():
    """`kestrel serve` reads llama-server's LLAMA_ARG_* variables into its defaults while the
    parser is built: build it without them, so the page shows the real defaults."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("LLAMA_")}
    try:
        yield
    finally:
        os.environ.update(saved)


def subparsers() -> dict[str, argparse.ArgumentParser]:
    """kestrel's subcommands, built exactly as `kestrel` builds them."""
    from kestrel.cli import build_parser

    with _without_llama_env():
        parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _env_vars(command: str) -> dict[str, str]:
    """flag dest -> the environment variable that sets its default (serve: llama-server's)."""
    if command != "serve":
        return {}
    from kestrel.server.args import LLAMA_ENV

    return LLAMA_ENV


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if action.nargs == 0:  # a switch: given or not
        if isinstance(action, argparse.BooleanOptionalAction):
            return "on" if action.default else "off"
        return "" if isinstance(action, argparse._HelpAction) else "off"
    if action.default in (None, "", []):
        return "none"
    if isinstance(action.default, float) and action.default.is_integer():
        return f"`{int(action.default)}`"
    return f"`{action.default}`"


def _row(action: argparse.Action, env: dict[str, str]) -> str:
    if action.option_strings:
        names = ", ".join(f"`{name}`" for name in action.option_strings)
        if action.nargs != 0 and (action.metavar or action.choices is None):
            names += f" `{action.metavar or action.dest.upper()}`"
    else:
        names = f"`{action.metavar or action.dest}` (positional)"
    meaning = _cell(action.help or "")
    if action.choices is not None and not isinstance(action, argparse.BooleanOptionalAction):
        choices = ", ".join(f"`{c}`" for c in action.choices)
        meaning = f"{meaning} (one of {choices})" if meaning else f"one of {choices}"
    variable = f"`{env[action.dest]}`" if action.dest in env else ""
    return f"| {names} | {_default(action)} | {variable} | {meaning} |"


def flag_reference(command: str) -> str:
    """The Markdown reference of `kestrel COMMAND`'s flags: one table per argument group, in the
    order `--help` prints them."""
    parser = subparsers()[command]
    env = _env_vars(command)
    out = []
    for group in parser._action_groups:
        actions = group._group_actions
        if not actions:
            continue
        title = "general" if group.title == "options" else group.title
        out += [
            f"#### {title[0].upper()}{title[1:]}",
            "",
            "| flag | default | environment | meaning |",
            "|---|---|---|---|",
        ]
        out += [_row(action, env) for action in actions]
        out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, **kwargs) -> str:
    """MkDocs' hook: expand every `<!-- kestrel-flags: COMMAND -->` line."""
    return MARKER.sub(lambda m: flag_reference(m.group(1)), markdown)
