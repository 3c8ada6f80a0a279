"""Subcommands of ``nanoverify``; see optimized/cli.py."""
