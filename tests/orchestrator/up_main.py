"""`orch up` with the fake rank classes (run as a subprocess by test_up.py)."""

import sys

from orchestrator.config.load import load_config
from orchestrator.up import run_up
from tests.orchestrator.fake_ranks import CLASSES

if __name__ == "__main__":
    sys.exit(run_up(load_config(sys.argv[1]), rank_classes=CLASSES))
