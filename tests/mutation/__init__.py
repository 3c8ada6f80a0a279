"""Mutation testing of the scheduler: single-edit mutants of reference/ and the optimized core (spec/mutation.md).

``python -m tests.mutation`` (or ``bash scripts/mutation.sh``) makes a seeded,
reproducible sample of mutants (``mutants.py``), runs the scheduler tests
against each in a copy of the tree (``runner.py``) and prints the score and
every survivor. What it mutates and which tests judge lives in ``targets.py``
alone. It is a development tool, kept under tests/ so the installed package
does not ship it.
"""
