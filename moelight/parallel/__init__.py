"""Tensor parallelism over the devices of one node: shards and ranks.

`sharding.py` splits a model Megatron-style; `shard_loader.py` loads one rank's shard straight
from the checkpoint; `rank_group.py` starts and joins the ranks (spawned followers running the
entry point they are handed, or torchrun's). The engine's side (rank 0's lockstep engine, the
followers' loop) is in moelight/engine/. The model code only sees `layer.tp_reduce`.
"""

from moelight.parallel.sharding import TensorParallelError, shard_config, shard_model, tensor_parallel_problems

__all__ = ["TensorParallelError", "shard_config", "shard_model", "tensor_parallel_problems"]
