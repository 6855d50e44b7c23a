"""``orch plan``: predict TTFT, TPOT and output tokens/s of a layout before deploying it.

- :mod:`.specs`: device descriptions (``devices.yaml``, one data file), per-kernel
  efficiencies and the EP library's all-to-all figures.
- :mod:`.calibrate`: the ``cpu`` device, measured on this machine and cached
  (:mod:`.calibrate_serving`: its served steps).
- :mod:`.counts`: parameters, FLOPs and KV bytes a token costs.
- :mod:`.moe`: step options (overlap, MTP, EPLB), expert slots, imbalance, the all-to-all.
- :mod:`.cost`: the terms and seconds of one prefill and one decode step, from
  :mod:`.kernel_terms` (rooflines), :mod:`.comm_terms` (collectives, the KV transfer),
  :mod:`.host_terms` at :mod:`.hardware`'s achieved rates; :mod:`.terms`: the work, term
  and cost values (:mod:`.explain`: them printed).
- :mod:`.load`: the operating point (queueing, batch, throughput) of a workload.
- :mod:`.report`: the plan of an ``OrchConfig`` and its printed table.
- :mod:`.versus`: the plan next to ``orch bench`` on a running cpu deployment.
- :mod:`.validation`: the plan held against published large-EP results.

docs/planner.md describes the model, the sources of its figures and its validation.
"""
