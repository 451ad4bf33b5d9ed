"""The model around the decoder layers, common to every family: embedding, layers, final norm,
LM head. Tokens are packed ([T, hidden], no padding); the attention itself runs outside the
layers, next to the KV cache (moelight/runtime/forward.py, the CGOPipe executor)."""

from __future__ import annotations

import torch
from torch import nn

from moelight.models.config import ModelConfig
from moelight.models.layers import make_norm
from moelight.models.rope import rotary_cos_sin


class MoECausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        from moelight.models import family

        super().__init__()
        self.config = cfg
        layer = family(cfg.model_type).DecoderLayer
        # no init pass: weights are always loaded or drawn after construction (loading/weights.py), and
        # nn.Embedding's normal_ on the meta device imports torch._dynamo, ~2 s of every job's start
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype):
        return rotary_cos_sin(positions, self.config, dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head, in float32 for sampling."""
        return self.lm_head(self.norm(x)).float()
