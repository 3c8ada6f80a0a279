"""The ``nanoverify`` command (``main``) and its subcommands, one module each."""

from optimized.cli.command import main

__all__ = ["main"]
