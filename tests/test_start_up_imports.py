"""A job's start does not import torch's compiler stack: sizing the model on the meta device, allocating
it and starting the emulated device once pulled in torch._dynamo and sympy (~3-6 s of every
`moelight run`, spawned tensor-parallel rank and Ray replica); nor triton (the fused dequant-GEMM imports
it on first use, on CUDA). Checked in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import sys
from dataclasses import replace
import torch
from moelight.loading.presets import PRESETS
from moelight.loading.weights import build_model
from moelight.models.expert_format import quantize_format
from moelight.pipeline.pipeline_executor import PipelineExecutor
from moelight.planning.memory_check import parameter_count, weight_bytes

cfg = PRESETS["tiny"]
weight_bytes(cfg, torch.bfloat16, on_cpu=True)
parameter_count(cfg)
build_model(replace(cfg, expert_format=quantize_format("int4", (cfg.hidden_size, cfg.intermediate_size), 32)),
            torch.bfloat16, None, 0)
model = build_model(cfg, torch.float32, None, 0)
ex = PipelineExecutor(model, "cgopipe", "emulated", r_w=0.5, max_batch=4, max_context=64, max_prompt_len=32,
                      max_prefill_tokens=64)
ex.close()
print(sorted(m for m in ("torch._dynamo", "sympy", "triton") if m in sys.modules))
"""


def test_sizing_loading_and_the_emulated_device_import_no_compiler():
    res = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "[]", res.stdout
