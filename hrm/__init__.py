"""Hierarchical Roofline Model (HRM) for MoE inference: specs, operator costs, roofs.

numpy only (matplotlib for hrm.plots); never imports torch, so planning runs anywhere.
"""

from hrm.dtypes import DTYPE_BYTES, canonical_dtype, dtype_bytes
from hrm.hardware import HardwareSpec, Level, Link
from hrm.hardware_presets import DEFAULT_PROFILE_PATH, HARDWARE_PRESETS, get_hardware, list_hardware
from hrm.model import ModelSpec, load_model_dir, model_from_hf_config
from hrm.model_presets import MODEL_PRESETS, get_model, list_models
from hrm.workload import WorkloadSpec

__all__ = [
    "DEFAULT_PROFILE_PATH", "DTYPE_BYTES", "HARDWARE_PRESETS", "MODEL_PRESETS", "HardwareSpec", "Level",
    "Link", "ModelSpec", "WorkloadSpec", "canonical_dtype", "dtype_bytes", "get_hardware", "get_model",
    "list_hardware", "list_models", "load_model_dir", "model_from_hf_config",
]
