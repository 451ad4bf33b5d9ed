"""What runs the model's passes on the host: the executor interface (`executor.py`), the plain CPU
executor (`plain_executor.py`) and its whole-model passes (`forward.py`), the ragged KV cache on
huge pages (`kv_cache.py`, `host_memory.py`) and pre-packed CPU matmuls (`cpu_linear.py`)."""
