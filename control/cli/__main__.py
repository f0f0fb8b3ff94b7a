"""`python -m control.cli` runs the `levers9` CLI (as the tests and benchmarks do)."""

import sys

from control.cli.main import main

sys.exit(main())
