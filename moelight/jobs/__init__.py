"""Jobs: what a front end asks for, from requests in to results and a report out.

`dataset_job.py` (`moelight run`: a dataset file, locally, as a CoE job or on Ray),
`dataset_input.py` (reading and resume), `prompts.py` (tokenize, fit to the context, seed),
`serving.py` (plan, load, generate every turn, write each result), `output_file.py`, `report.py`,
`coe_job.py` (several checkpoints on one device), `trace_job.py` (`moelight trace`), `ray/`.
"""
