"""``python -m bench.chaos``: see the package's docstring."""

import sys

from bench.chaos.cli import main

sys.exit(main())
