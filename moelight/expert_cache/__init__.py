"""Small-batch mode: a device expert cache fed by demand fetches and prediction (DESIGN.md section 8).

`routing_trace.py` (the routing-trace format; `moelight trace` records one: jobs/trace_job.py);
`eam.py` (MoE-Infinity's expert activation matrices); the policies (`cache_policy.py` the interface,
`baseline_policies.py`, `moe_infinity_policy.py`, `learned_policies.py` + `predictors.py`,
`combined_policy.py`; by name: `policy_registry.py`); `cache_state.py` (the deterministic cache both
drivers share); `cache_executor.py` + `copy_worker.py` (the runtime, latency mode) and
`cache_simulator.py` + `link_queue.py` (the trace replay with HRM costs, `moelight simulate-cache`).
"""
