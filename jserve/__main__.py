"""`python -m jserve ...`: the `jserve` command, for environments without its script on PATH."""

import sys

from jserve.cli import main

sys.exit(main())
