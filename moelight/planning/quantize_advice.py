"""What to do when a job with 16-bit routed experts does not fit: whether `--quantize int8` or `int4` would.

The planner's refusal says by how much memory is short; the user's next question is whether quantized experts
would fit, and which. Asked of the same planner with the experts held as `--quantize` would hold them, so the
advice is never more hopeful than the run that follows it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from moelight.models.config import ModelConfig
from moelight.models.expert_format import quantize_format, rank_widths


def quantize_advice(cfg: ModelConfig, quantize: str, ranks: int, fits: Callable[[ModelConfig], str | None]) -> str:
    """A sentence to append to a refusal ("" where `--quantize` is not the user's lever: already given, or the
    checkpoint ships its experts quantized). `fits(cfg)`: what the plan would be for `cfg` (e.g. its batch and
    predicted rate), None where it does not fit either. int8 first: it fits less often but keeps more of the
    model's quality."""
    if quantize != "none" or cfg.expert_format is not None or (cfg.checkpoint_quant and not cfg.experts_all_float):
        return ""
    widths = rank_widths(cfg.hidden_size, cfg.intermediate_size, ranks)
    for method in ("int8", "int4"):
        try:
            form = quantize_format(method, widths)
        except ValueError:  # no int4 group divides the widths
            continue
        planned = fits(replace(cfg, expert_format=form))
        if planned is not None:
            return f"; with --quantize {method} it fits: {planned}"
    return "; it would not fit with --quantize int4 either"


def planned_text(batch: int, tok_s: float) -> str:
    """What `fits` says of a plan that fits: its batch and predicted end-to-end rate."""
    return f"batch {batch}, predicted {tok_s:.1f} tok/s end-to-end"
