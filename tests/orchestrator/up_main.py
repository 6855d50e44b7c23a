"""`orch up` with the fake rank class and roles (run as a subprocess by test_up.py)."""

import sys

from orchestrator.config.load import load_config
from orchestrator.up import run_up
from tests.orchestrator.fake_ranks import ROLES, FakeRank

if __name__ == "__main__":
    sys.exit(run_up(load_config(sys.argv[1]), roles=ROLES, rank_class=FakeRank))
