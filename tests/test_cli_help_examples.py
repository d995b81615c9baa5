"""Every `hexiscale COMMAND --help` says what the command does and shows at least one example, and
every example it shows parses with the command's own parser (so the help cannot go stale)."""

from __future__ import annotations

import shlex

import pytest

from lightning_hexiscale.cli.main import build_parser

PARSER = build_parser()
COMMANDS = next(a for a in PARSER._subparsers._group_actions).choices


def examples(command: str) -> list[str]:
    text = COMMANDS[command].format_help()
    head = "examples:" if "examples:" in text else "example:"
    assert head in text, f"`hexiscale {command} --help` shows no example"
    block = text.split(head, 1)[1].split("\n\n", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip().startswith(("hexiscale", "sudo hexiscale"))]


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "train"])  # train: Hydra's own help, tested apart
def test_help_shows_examples_that_parse(command):
    shown = examples(command)
    assert shown
    for line in shown:
        argv = [a for a in shlex.split(line.split("  #", 1)[0]) if a != "&"]  # & : run in the background
        argv = argv[argv.index("hexiscale") + 1:]
        if "--" in argv:  # emulate: the command after -- is not ours to parse
            argv = argv[:argv.index("--")]
        args = PARSER.parse_args(argv)
        assert args.command == command, line
