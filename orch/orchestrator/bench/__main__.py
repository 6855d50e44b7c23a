"""``python -m orch.orchestrator.bench``: ``orch bench`` without the lead CLI."""

import sys

from orch.orchestrator.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
