"""`orch up` with fake ranks whose leaders never finish ``drain`` or ``shutdown`` (a rank stuck
in a failing transfer); run as a subprocess by test_up_teardown.py."""

import sys
import threading

from orchestrator.config.load import load_config
from orchestrator.up import run_up
from tests.orchestrator import fake_ranks


class _Stuck:
    """NOTE: waits on an event nobody sets: the call hangs until the actor is killed."""

    def drain(self, timeout_s: float) -> None:
        threading.Event().wait()

    def shutdown(self) -> None:
        threading.Event().wait()


class StuckRank(_Stuck, fake_ranks.FakeRank):
    pass


if __name__ == "__main__":
    sys.exit(run_up(load_config(sys.argv[1]), roles=fake_ranks.ROLES, rank_class=StuckRank))
