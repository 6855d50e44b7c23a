"""How the multi-process tests start their rank processes (gloo groups across processes: TP,
CP, EP, KV pairs): forked from one server process that imported torch, the engine and the KV
transfer package once per test session (``forkserver``), not each a fresh interpreter
(``spawn``). A spawned rank imported torch again: 2-3 s of CPU each, ~4 ranks per test.

NOTE: a forked rank starts clean as a spawned one does (the server imports modules only: no
thread pool, no process group, no tensor op ran in it); what it does not see is the test's
environment as changed after the server started (it has the server's): pass what a rank
needs as arguments, as every test here does. ``set_forkserver_preload`` acts only before the
server's first start: every user imports this module, none starts a forkserver otherwise.
"""

from __future__ import annotations

import torch.multiprocessing as mp

START_METHOD = "forkserver"
CTX = mp.get_context(START_METHOD)
CTX.set_forkserver_preload(["torch", "engine.runner", "kv_transfer"])
