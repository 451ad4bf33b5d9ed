"""Named model shapes for `--load-format dummy` (random weights, no files), as vLLM does."""

from __future__ import annotations

from moelight.config import ModelConfig
from moelight.errors import ConfigError

PRESETS: dict[str, ModelConfig] = {
    # Fits anywhere; used by tests and the README's first command.
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, num_experts=4, top_k=2, head_dim=16, max_position_embeddings=2048),
    # The engine-core benchmark model (about 0.77 B parameters).
    "bench-1b": ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_layers=8,
                            num_heads=16, num_kv_heads=4, num_experts=8, top_k=2, head_dim=64,
                            max_position_embeddings=4096),
    "mixtral-8x7b": ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
                                num_heads=32, num_kv_heads=8, num_experts=8, top_k=2, head_dim=128,
                                rope_theta=1e6, max_position_embeddings=32768),
    "mixtral-8x22b": ModelConfig(vocab_size=32768, hidden_size=6144, intermediate_size=16384, num_layers=56,
                                 num_heads=48, num_kv_heads=8, num_experts=8, top_k=2, head_dim=128,
                                 rope_theta=1e6, max_position_embeddings=65536),
}


def preset_config(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown model preset {name!r}; presets: {', '.join(PRESETS)} (or pass a model folder)"
        ) from None
