"""`python -m attnres_compile.cli`: the console script's entry point."""

import sys

from .program import main

sys.exit(main())
