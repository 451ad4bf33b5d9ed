"""One rank's shard straight from the checkpoint (or the dummy initialiser), never the whole model.

Each whole parameter is assembled in a staging tensor of its full shape, cut to the rank's part
(`sharding.part_of`) the moment its last element arrives, and freed. A rank's host memory holds
its shard plus the parameters in flight, so all ranks load at once and the host needs the
model's size once (their shards together), not once per rank. The checkpoint path reuses the
loader's weight maps and coverage checks (`weights.fill_parameters`); the dummy path draws the
same values in the same order as `init_dummy_weights`, so a sharded dummy model is the shards of
the dummy model one device would build.
"""

from __future__ import annotations

import torch

from moelight.loading.model_source import ModelSource
from moelight.loading.weights import dummy_fill, empty_model, fill_parameters, fillable_parameters
from moelight.models.causal_lm import MoECausalLM
from moelight.models.quantized_experts import QuantizedExperts, hold_experts_quantized
from moelight.parallel.sharding import finish_shard, shard_config, take_part


class _Staging:
    """Whole-shaped tensors for the parameters being loaded, each cut into the shard when full
    (routed experts held quantized: a whole layer's codes and scales, then the rank's part of them)."""

    def __init__(self, source: ModelSource, part: MoECausalLM, rank: int, n: int) -> None:
        cfg = source.config
        with torch.device("meta"):
            whole = MoECausalLM(cfg)
            if cfg.expert_format is not None:
                hold_experts_quantized(whole, cfg.expert_format)
        self.whole = fillable_parameters(whole)  # the order the dummy initialiser fills in
        self.source, self.rank, self.n = source, rank, n
        self.params = fillable_parameters(part)
        self.open: dict = {}

    def numels(self) -> dict[str, int]:
        return {name: p.numel() for name, p in self.whole.items()}

    def dest(self, name: str):
        if name not in self.open:
            w = self.whole[name]
            self.open[name] = (QuantizedExperts(w.form, *w.shape) if isinstance(w, QuantizedExperts)
                               else torch.empty(w.shape, dtype=self.source.dtype))
        return self.open[name]

    def filled(self, name: str) -> None:
        take_part(self.params[name], name, self.open.pop(name), self.source.config, self.rank, self.n)


def load_shard(source: ModelSource, rank: int, n: int, all_reduce, seed: int = 0) -> MoECausalLM:
    """Rank `rank` of `n`'s model, with the all-reduce that sums its layers' partial outputs."""
    cfg = source.config
    part = empty_model(shard_config(cfg, n), source.dtype)
    staging = _Staging(source, part, rank, n)
    if source.load_format == "safetensors":
        fill_parameters(cfg, source.model_dir, staging.numels(), staging.dest, staging.filled)
    else:
        gen = torch.Generator().manual_seed(seed)
        for name in staging.whole:  # the whole model's order, lm_head included as before tying
            dummy_fill(name, staging.dest(name), gen)
            staging.filled(name)
    return finish_shard(part, cfg, all_reduce)
