"""Planning a job before anything loads: the hardware and device (`hardware_choice.py`), the policy
and the HRM's prediction (`job_plan.py`), throughput or latency mode (`mode_choice.py`), and
whether weights and KV cache fit in memory (`memory_check.py`)."""
