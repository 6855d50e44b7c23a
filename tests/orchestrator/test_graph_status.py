"""Graph modes travel from a rank's status (the token stream's status row) through the
GetStatus proto to `orch status`."""

from __future__ import annotations

from orchestrator.api.convert import status_from_proto, status_to_proto
from orchestrator.cli import format_status
from orchestrator.status import InstanceView
from rank.messages import InstanceStatusInfo
from rank.status_row import status_from_row, status_row

MODES = (("decode", "captured [1, 2]; eager 4 (RuntimeError: backend exploded)"),
         ("prefill", "captured"))


def _view(modes) -> InstanceView:
    info = InstanceStatusInfo(name="colocated-0", role="colocated", tp=1, graph_modes=modes)
    return InstanceView("colocated-0", "colocated", 1, "healthy", "", info)


def test_graph_modes_travel_to_orch_status():
    info = status_from_row(status_row(_view(MODES).status))
    assert info.graph_modes == MODES
    (back,) = status_from_proto(status_to_proto([_view(info.graph_modes)], 0, "tiny"))
    assert back.status.graph_modes == MODES
    assert ("    graph: decode captured [1, 2]; eager 4 (RuntimeError: backend exploded); "
            "prefill captured") in format_status([back]).splitlines()
    assert "graph:" not in format_status([_view(())])
