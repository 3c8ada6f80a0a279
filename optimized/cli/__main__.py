"""``python -m optimized.cli``: the ``nanoverify`` command."""

import sys

from optimized.cli.command import main

sys.exit(main())
