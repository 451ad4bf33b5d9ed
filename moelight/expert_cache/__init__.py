"""Small-batch mode: a device expert cache fed by demand fetches and prediction (DESIGN.md section 8).

`trace.py` (the routing-trace format) and `tracer.py` (`moelight trace`); `eam.py` (MoE-Infinity's
expert activation matrices); `policies.py` (on-demand, LRU, LFU, MoE-Infinity) and `cache_state.py`
(the deterministic cache both drivers share); `executor.py` + `copy_worker.py` (the runtime, latency
mode) and `simulator.py` (the trace replay with HRM costs, `moelight simulate-cache`).
"""
