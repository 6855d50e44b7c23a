"""A rank whose start-up was interrupted (``init_rank`` never ran, so neither did
``setup_role``) drains and shuts down quietly: `orch up` interrupted during start-up tears such
ranks down without an AttributeError from a connector or scheduler that was never built."""

from __future__ import annotations

import pytest

from decode_worker.actor import DecodeRank
from prefill_worker.actor import PrefillRank
from rank.colocated import ColocatedRank
from rank.config import InstanceConfig, SchedulerConfig


@pytest.mark.parametrize("cls, role", [(PrefillRank, "prefill"), (DecodeRank, "decode"),
                                       (ColocatedRank, "colocated")])
@pytest.mark.parametrize("rank", [0, 1])
def test_rank_never_set_up_tears_down_quietly(cls, role, rank):
    scheduler = SchedulerConfig(block_size=4, num_kv_blocks=8, chunk_size=8,
                                max_num_batched_tokens=16, max_num_seqs=4)
    actor = cls(InstanceConfig(name=f"{role}-0", role=role, checkpoint_dir="/nonexistent",
                               scheduler=scheduler), rank)
    assert actor.drain(timeout_s=5.0) is True
    actor.shutdown()
