"""`hexiscale`: the command-line entry point. One module per subcommand registers itself
(:func:`lightning_hexiscale.cli.common.subcommand`); this module imports them all and dispatches.

    hexiscale estimate --plan conf/plans/hetero3_llama30b_tab7.yaml cluster=hetero3 model=llama_30b
    hexiscale train cluster=cpu2 model=llama_tiny trainer.max_steps=2

The subcommands that read the configuration (plan, estimate, cluster, calibrate, check-estimate, train)
take Hydra-style overrides after their options, composed over conf/config.yaml; the others refuse them.
Bad input exits with status 2 and a one-paragraph message (key, value, rule, fix); no traceback.
Ctrl-C exits with status 130 and one line.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import warnings
from collections.abc import Sequence

# Importing a command module registers it; the order of these names is the order of `hexiscale --help`.
# They load on first use (load_commands): `hexiscale train ...` loads only its own module, so that
# `hexiscale train --help` answers without importing torch (calibrate and profile import it).
COMMAND_MODULES = (
    "estimate",
    "presets",
    "plan",
    "profile",
    "discover",
    "calibrate",
    "prepare_data",
    "export",
    "checkpoint",
    "emulate",
    "rendezvous",
    "train",
)


def load_commands() -> None:
    """Import every command module (each registers itself in ``SUBCOMMANDS``)."""
    import importlib

    for name in COMMAND_MODULES:
        importlib.import_module(f"lightning_hexiscale.cli.{name}")


from lightning_hexiscale.cli.common import (EPILOG, end_command, NO_OVERRIDES, SUBCOMMANDS, examples_text, notice_printer,
                                            version_line)
from lightning_hexiscale.errors import HexiScaleError

EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT, as shells report it)."""


class _Version(argparse.Action):
    """``--version``: argparse's own version action takes the text when the parser is built, and reading
    the packages' metadata costs ~25 ms, which every ``hexiscale`` call paid; this reads it when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    load_commands()
    parser = argparse.ArgumentParser(
        prog="hexiscale", description="Plan and estimate asymmetric parallel LLM training on heterogeneous GPU clusters.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    parser.add_argument("--version", action=_Version,
                        help="print the versions of hexiscale, torch, Lightning, Hydra and Python, and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_, configure, _fn) in SUBCOMMANDS.items():
        takes = name not in NO_OVERRIDES
        epilog = "\n\n".join(t for t in (examples_text(name), EPILOG if takes else None) if t) or None
        p = sub.add_parser(name, help=help_, description=help_, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        configure(p)
        if takes:
            p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra-style config overrides")
    parser.set_defaults(command_parsers=sub.choices)  # an unknown flag is refused by its command's parser
    return parser


def unknown_flags(bad: Sequence[str], command: argparse.ArgumentParser) -> str:
    """The error for flags ``command`` does not take: the closest of its options, else the list of them."""
    # argparse keeps a parser's options in _actions only (no public accessor); 3.11's argparse suggests nothing
    options = [s for a in command._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
    near = [m for b in bad for m in difflib.get_close_matches(b.split("=", 1)[0], options, n=1, cutoff=0.6)]
    if near:
        fix = f"did you mean {' / '.join(dict.fromkeys(near))}?"
    elif options:
        fix = f"{command.prog} takes {', '.join(options)}"
    else:
        takes = any(a.dest == "overrides" for a in command._actions)
        fix = f"{command.prog} takes no options{' (only KEY=VALUE overrides)' if takes else ''}"
    return f"unrecognized arguments: {' '.join(bad)}. Fix: {fix}{' ' if fix.endswith('?') else '. '}See {command.prog} --help"


def command_list() -> str:
    """The commands, sorted (SUBCOMMANDS is in the order their modules were imported)."""
    return ", ".join(sorted(SUBCOMMANDS))


def unknown_command(word: str) -> str:
    """The error for a first word that names no command: the closest command, or an override's hint."""
    if "=" in word:  # `hexiscale cluster=cpu2`: overrides with no command before them
        return (f"{word!r} comes before any command. Fix: name the command first, e.g. hexiscale plan {word} "
                f"(commands: {command_list()})")
    near = difflib.get_close_matches(word, list(SUBCOMMANDS), n=1, cutoff=0.6)
    fix = f"did you mean {near[0]}?" if near else f"use one of {command_list()}."
    return f"no command {word!r}. Fix: {fix} See hexiscale --help"


JOINS_FROM_ENV = frozenset({"discover", "profile", "calibrate", "check-estimate"})
"""Commands whose ranks join the launcher's process group themselves (without ``--local``): under srun
their rendezvous comes from :mod:`lightning_hexiscale.cli.slurm_env`."""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command_argv = None
    if argv[:1] == ["emulate"] and "--" in argv:  # `hexiscale emulate C -- CMD ...`: CMD is not ours to parse
        cut = argv.index("--")
        argv, command_argv = argv[:cut], argv[cut + 1:]
    if argv[:1] == ["train"]:  # a Hydra app: Hydra parses its flags (-m, --cfg) and overrides, not argparse
        from lightning_hexiscale.cli import train

        return train.main(argv[1:], train.HEXISCALE, ("train",))
    parser = build_parser()
    if argv and not argv[0].startswith("-") and argv[0] not in SUBCOMMANDS:
        parser.error(unknown_command(argv[0]))
    args, extra = parser.parse_known_args(argv)
    args.command_argv = command_argv
    if args.command is None:
        if extra:  # `hexiscale --json`: a flag before any command
            parser.error(f"unrecognized arguments: {' '.join(extra)}. Fix: a command comes first "
                         f"(hexiscale COMMAND [options]; commands: {command_list()}). See hexiscale --help")
        parser.print_help()
        return 2
    bad = [e for e in extra if e.startswith("-")]
    if bad:
        command = args.command_parsers[args.command]
        command.error(unknown_flags(bad, command))
    args.overrides = list(getattr(args, "overrides", [])) + extra
    if args.overrides and args.command in NO_OVERRIDES:
        print(f"hexiscale {args.command}: error: hexiscale {args.command} = {' '.join(args.overrides)!r}: takes no "
              f"overrides (it reads no cluster, model or train configuration). Fix: drop them; "
              f"{NO_OVERRIDES[args.command]}", file=sys.stderr)
        return 2
    for o in args.overrides:
        if "=" not in o:
            from lightning_hexiscale.cli.common import bare_word_error

            print(f"hexiscale {args.command}: error: {bare_word_error(o)}", file=sys.stderr)
            return 2
    if not getattr(args, "multirun", False):  # cluster=a,b without -m: a sweep, said in this command's words
        from lightning_hexiscale.config.compose_errors import sweep_error

        sweep = ("add -m to plan each value (hexiscale plan -m ...: one plan per value and one summary table)"
                 if hasattr(args, "multirun") else
                 f"hexiscale {args.command} takes one value per run (no -m): run it once per value; hexiscale plan -m "
                 "sweeps plans and hexiscale train -m runs")
        error = next((e for e in (sweep_error(o, sweep) for o in args.overrides) if e is not None), None)
        if error is not None:
            print(f"hexiscale {args.command}: error: {error}", file=sys.stderr)
            return 2
    if args.command in JOINS_FROM_ENV and not getattr(args, "local", None):
        from lightning_hexiscale.cli.slurm_env import fill_slurm_rendezvous

        fill_slurm_rendezvous()  # srun sets no MASTER_ADDR/PORT: taken from SLURM's variables, as Lightning does
    default_show = warnings.showwarning
    warnings.showwarning = notice_printer(f"hexiscale {args.command}", default_show)
    try:
        return SUBCOMMANDS[args.command][2](args)
    except HexiScaleError as e:
        print(f"hexiscale {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback; nothing half-written (files are written last)
        print(f"\nhexiscale {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `hexiscale ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except OSError as e:  # after BrokenPipeError, an OSError too
        if e.filename is None:  # not about a path: a fault of ours, shown whole
            raise
        from lightning_hexiscale.cli.common import os_error_line

        print(f"hexiscale {args.command}: error: {os_error_line(e)}", file=sys.stderr)
        return 2
    finally:
        warnings.showwarning = default_show


def console_main() -> None:
    """The ``hexiscale`` command: :func:`main`, then the exit. Ranks that joined a process group
    (``profile``, ``calibrate``, ``check-estimate`` under torchrun) leave through
    :func:`~lightning_hexiscale.profiling.launch.exit_process`, which skips the interpreter shutdown
    that can abort them after their work is done. The module is looked up, not imported: the other
    commands never load torch.distributed. The rest end through :func:`~.common.end_command`."""
    try:
        code = main()
    except KeyboardInterrupt:  # while reading the command line or importing a subcommand
        print("\nhexiscale: interrupted (Ctrl-C)", file=sys.stderr)
        code = EXIT_INTERRUPTED
    launch = sys.modules.get("lightning_hexiscale.profiling.launch")
    if launch is not None:
        launch.exit_process(code)
    end_command(code)


if __name__ == "__main__":  # pragma: no cover
    console_main()
