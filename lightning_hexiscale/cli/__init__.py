"""The `hexiscale` command line: :func:`main` is the entry point, one module per subcommand."""

from lightning_hexiscale.cli.main import main

__all__ = ["main"]
