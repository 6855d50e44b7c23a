"""``orch bench``: workload replay client, statistics and reports (see docs/bench.md).

Files follow the path of a run: traces -> prompts -> workloads -> runner -> report ->
plots / compare; cli wires them to ``orch bench``.
"""
