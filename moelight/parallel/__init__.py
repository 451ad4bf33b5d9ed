"""Tensor parallelism over the devices of one node: shards and ranks.

`sharding.py` splits a model Megatron-style; `shard_loader.py` loads one rank's shard straight
from the checkpoint; `rank_group.py` starts and joins the ranks (spawned followers running the
entry point they are handed, or torchrun's). The engine's side (rank 0's lockstep engine, the
followers' loop) is in moelight/engine/. The model code only sees `layer.tp_reduce`.

Multi-head latent attention (DeepSeek) splits its heads the same way (q / q_b and kv_b rows, O
columns) and replicates the latent: every rank computes the whole latent row of a token (the small
kv_a projection, h x 576) and keeps it in its own latent cache, then attends its own heads over it.
Why not split it: every head reads the whole row (scores over latent + RoPE key, values from the
latent), so a row split along its width would need an all-reduce of partial scores for every key
and step, and a split by sequence would need every head's query on every rank. The price is N
copies of the latent cache in host memory (N x 1,152 B per token and layer in bf16: at N = 4
more than Mixtral's unsplit 4,096 B) and N reads of it per step; the planner and the memory check
count both.
"""

from moelight.parallel.sharding import TensorParallelError, shard_config, shard_model, tensor_parallel_problems

__all__ = ["TensorParallelError", "shard_config", "shard_model", "tensor_parallel_problems"]
