"""Tensor parallelism over the devices of one node: shards, ranks and the lockstep engine.

`sharding.py` splits a loaded model Megatron-style; `rank_group.py` starts and joins the
ranks (spawned followers, or torchrun's); `lockstep.py` is rank 0's engine, which hands each
call to the followers before running it. The model code only sees `layer.tp_reduce`.
"""

from moelight.parallel.sharding import TensorParallelError, shard_config, shard_model, tensor_parallel_problems

__all__ = ["TensorParallelError", "shard_config", "shard_model", "tensor_parallel_problems"]
