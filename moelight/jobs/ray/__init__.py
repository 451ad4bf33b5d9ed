"""`moelight run --ray`: the dataset job as a Ray Data pipeline of engines (one per actor).

`ray_job.py` (the driver), `ray_dataset.py` (reading and checking the file), `replica.py` (the
engine actor and the prompt checker), `resources.py` (the cluster and the pool), `ray_report.py`.
The Ray Data processor for Python users is the front end `moelight.ray`.
"""
