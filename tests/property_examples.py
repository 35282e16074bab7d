"""How many examples the slowest property tests draw.

The README's test command (CI) draws a fifth of each one's full count, so that the suite
stays within its time budget (issue 30: these tests were about a third of it);
`bench/nightly.sh` sets `JSERVE_PROPERTY_EXAMPLES=full` and draws every example. A test
states its full count, so the nightly count is the one the test was written for.
"""

from __future__ import annotations

import os

FULL = os.environ.get("JSERVE_PROPERTY_EXAMPLES") == "full"
FRACTION = 5  # CI draws 1/FRACTION of the full count
MINIMUM = 10  # and never fewer than this


def examples(full: int) -> int:
    """`full` under the nightly run, else a fifth of it (at least `MINIMUM`)."""
    return full if FULL else max(min(full, MINIMUM), full // FRACTION)
