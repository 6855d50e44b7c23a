"""A rank whose start-up was interrupted (``init_rank`` never ran, so its role was never
built) drains and shuts down quietly: `orch up` interrupted during start-up tears such
ranks down without an AttributeError from a connector or scheduler that was never built."""

from __future__ import annotations

import pytest

from decode_worker.role import DecodeRole
from prefill_worker.role import PrefillRole
from rank.colocated import ColocatedRole
from rank.config import InstanceConfig, SchedulerConfig
from rank.rank import Rank


@pytest.mark.parametrize("cls, role", [(PrefillRole, "prefill"), (DecodeRole, "decode"),
                                       (ColocatedRole, "colocated")])
@pytest.mark.parametrize("rank", [0, 1])
def test_rank_never_set_up_tears_down_quietly(cls, role, rank):
    scheduler = SchedulerConfig(block_size=4, num_kv_blocks=8, chunk_size=8,
                                max_num_batched_tokens=16, max_num_seqs=4)
    actor = Rank(InstanceConfig(name=f"{role}-0", role=role, checkpoint_dir="/nonexistent",
                                scheduler=scheduler), rank, cls)
    assert actor.drain(timeout_s=5.0) is True
    actor.shutdown()
