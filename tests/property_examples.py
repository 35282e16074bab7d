"""How many examples the slowest property tests draw.

The README's test command (CI) draws a tenth of each one's full count (at least ten), so that
the suite stays within its time budget (issue 30: these tests were about a third of it; a
fifth left the suite at 375-380 s against its 360); every CI run draws other traces, so
landings add up to the nightly's coverage;
`bench/nightly.sh` sets `JSERVE_PROPERTY_EXAMPLES=full` and draws every example. A test
states its full count, so the nightly count is the one the test was written for.
"""

from __future__ import annotations

import os

FULL = os.environ.get("JSERVE_PROPERTY_EXAMPLES") == "full"
FRACTION = 10  # CI draws 1/FRACTION of the full count
MINIMUM = 10  # and never fewer than this


def examples(full: int) -> int:
    """`full` under the nightly run, else a tenth of it (at least `MINIMUM`)."""
    return full if FULL else max(min(full, MINIMUM), full // FRACTION)
