"""``python -m orchestrator.bench``: ``orch bench`` without the lead CLI."""

import sys

from orchestrator.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
