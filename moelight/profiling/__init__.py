"""`moelight profile`: this machine's HRM terms measured with the engine's own kernels (CPU in
`machine_profile.py`, GPU and link in `gpu_profile.py`), one best-of-n timer (`timing.py`)."""
