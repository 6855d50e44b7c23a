"""Expert-parallel bring-up of one rank (``ParallelConfig.ep``): its end of the role's EP group
and, on a leader, of the role's DP sync (rank/dp_sync.py).

Both rendezvous on the role's EP store, which the leader of the role's first instance (EP
rank 0) opens and orchestrator/deploy/cluster.py hands to every rank of the role as ``(host,
port)``; that leader passes the store object itself (it is the store's master). EP rank of
TP (or CP) rank ``r`` of DP rank ``d``: ``d * ranks + r``, of ``dp * ranks`` (ranks = tp * cp).
"""

from __future__ import annotations

from torch.distributed import Store

from engine.parallel import EPGroup, init_ep_group
from rank.config import ParallelConfig
from rank.dp_sync import DPSync, open_dp_sync


def join_ep_group(par: ParallelConfig, tp_rank: int, ep_store: tuple[str, int] | None,
                  store: Store | None = None) -> EPGroup | None:
    """TP rank ``tp_rank``'s ``EPGroup`` (collective over every rank of the role, each
    collective then bounded by ``step_timeout_s``); None when ``ep`` is off.

    Raises:
        ValueError: ``ep`` is on and no ``ep_store`` was given.
        torch.distributed.DistStoreError / RuntimeError: the role's ranks did not all arrive
            within ``step_timeout_s``.
    """
    if not par.ep:
        return None
    if ep_store is None:
        raise ValueError("ep is on but init_rank got no ep_store (host, port): the role's "
                         "first leader's open_ep_store() gives it")
    host, port = ep_store
    return init_ep_group(par.ep_rank(tp_rank), par.ep_size, host, port, par.dist_backend,
                         par.step_timeout_s, store=store)


def join_dp_sync(par: ParallelConfig, ep_store: tuple[str, int], connect_timeout_s: float,
                 store: Store | None = None) -> DPSync | None:
    """A leader's end of the role's DP sync (collective over the role's ``dp`` leaders);
    None with one DP rank (nobody to agree with: the instance's ranks follow its leader).

    Raises:
        torch.distributed.DistStoreError: the other leaders did not arrive in time.
    """
    if par.dp == 1:
        return None
    host, port = ep_store
    return open_dp_sync(host, port, par.dp_rank, par.dp, par.step_timeout_s,
                        connect_timeout_s, store=store)
