"""The Python front end: `LLM` in the shape of vLLM's offline API, and its output types.

`from moelight import LLM, SamplingParams` is the public way in; `LLM` runs the same job path as
`moelight run` (engine/session_start.py -> jobs/serving.py).
"""
