"""The HRM's model of a job's model as the run holds it in memory.

config.json gives the shapes; the routed experts are priced in the form the run keeps them
(`--quantize`, or a quantized checkpoint's experts as shipped: loading/expert_storage.py chooses).
`moelight plan` and a run's plan (planning/job_plan.py) both price a model here, so the policy plan
prints is the one run plans (plan once priced a GPTQ checkpoint's experts at 16 bits).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hrm import ModelSpec
    from moelight.models.config import ModelConfig


def held_model_spec(cfg: ModelConfig, name: str | None = None) -> ModelSpec:
    """hrm.ModelSpec of `cfg`, whose `expert_format` (None: the run's dtype) says how the experts are held;
    its max_position is the context RoPE scaling stretched (ModelConfig.context_length), as run checks it."""
    from hrm import model_from_hf_config

    mspec = replace(model_from_hf_config(cfg.to_hf_dict(), name=name), max_position=cfg.context_length)
    return mspec if cfg.expert_format is None else cfg.expert_format.held_in(mspec)
