"""``orch plan``: predict TTFT, TPOT and output tokens/s of a layout before deploying it.

- :mod:`.specs`: device descriptions (``devices.yaml``, one data file) and efficiency factors.
- :mod:`.calibrate`: the ``cpu`` device, measured on this machine and cached
  (:mod:`.calibrate_serving`: its served steps).
- :mod:`.cost`: FLOPs, bytes and seconds of one prefill, one decode step, one KV transfer.
- :mod:`.load`: the operating point (queueing, batch, throughput) of a workload.
- :mod:`.report`: the plan of an ``OrchConfig`` and its printed table.
- :mod:`.versus`: the plan next to ``orch bench`` on a running cpu deployment.

docs/planner.md describes the model and its fitted factors.
"""
