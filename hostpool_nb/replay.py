"""``python -m hostpool_nb.replay PATH``: replay a recorded trace and check every result.

Exit status 0 when every operation matches its record, 1 with the first
divergence (operation number, expected, got), 2 when the file cannot be
read as a trace. See :mod:`hostpool_nb.trace`.
"""

from __future__ import annotations

import sys

from .trace import main

if __name__ == "__main__":
    sys.exit(main())
