"""`python -m jbps ...` is the `jbps` command (jbps run, bench, plan, ...)."""

import sys

from .cli import main

sys.exit(main())
