"""Sampling: `SamplingParams` in vLLM's names and the per-request seed rule (`params.py`), and a
vectorised sampler with one generator per request (`sampler.py`)."""
