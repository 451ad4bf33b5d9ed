"""The engine: a session holding the loaded model and its executor, and the generation loop.

`session.py` (the model, its executor, plan -> memory check -> load), `session_start.py` (what a
front end calls), `generation.py` (the loop: admit, prefill, decode, sample, finish),
`scheduler.py` + `slot_pool.py` + `batching.py` (which sequences run where), `sequence.py`,
`executor_factory.py` (the executor a plan needs), `options.py` (every engine option, checked
before anything heavy), `lockstep.py` + `tp_follower.py` (tensor-parallel rank 0 and followers),
`host_cost.py` (the host's work per sequence and step, lent to `moelight profile`).
"""

from moelight.engine import host_cost  # noqa: F401  (registers the probe with moelight.profiling)
