"""``python -m loadgen ...`` runs the same command tree as ``kvkeeper ...``."""

from __future__ import annotations

import sys

from proxy.cli import main

sys.exit(main())
