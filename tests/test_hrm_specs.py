"""Hardware / model / workload specs: presets, JSON cache, HF config parsing, errors."""

import json
import sys

import pytest

from hrm import HARDWARE_PRESETS, HardwareSpec, WorkloadSpec, get_hardware, get_model, model_from_hf_config
from hrm.hardware import GiB, Level, Link
from hrm.model import load_model_dir

MIXTRAL_CFG = {
    "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "rope_theta": 1e6, "max_position_embeddings": 32768,
}
DBRX_CFG = {
    "model_type": "dbrx", "vocab_size": 100352, "d_model": 6144, "n_heads": 48, "n_layers": 40,
    "max_seq_len": 32768,
    "attn_config": {"kv_n_heads": 8, "rope_theta": 500000},
    "ffn_config": {"ffn_hidden_size": 10752, "moe_num_experts": 16, "moe_top_k": 4},
}


def test_presets_exist_with_paper_hosts():
    for name in ("t4", "l4", "a100-40gb", "a100-80gb", "h100", "s1", "s2", "s6", "s7", "s8", "s9"):
        assert name in HARDWARE_PRESETS
    s1, s7 = get_hardware("s1"), get_hardware("S7")
    assert s1.gpu.memory_bytes == 16 * GiB and s1.cpu.memory_bytes == 192 * GiB
    assert s7.gpu_count == 4 and s7.cpu.memory_bytes == 416 * GiB
    assert get_hardware("s2").gpu.name == "L4"


def test_tensor_parallel_aggregation():
    s7 = get_hardware("s7")
    tot = s7.gpu_total()
    assert tot.memory_bytes == 4 * s7.gpu.memory_bytes
    assert tot.bandwidth == 4 * s7.gpu.bandwidth
    assert tot.peak_flops("float16") == 4 * s7.gpu.peak_flops("float16")
    assert s7.link_total().h2d == 4 * s7.link.h2d
    assert s7.with_gpus(1).gpu_total().memory_bytes == s7.gpu.memory_bytes
    assert not s7.with_gpus(0).has_gpu
    with pytest.raises(ValueError):
        get_hardware("cpu-server").with_gpus(2)


def test_hardware_json_roundtrip(tmp_path):
    gpu = Level("gpu", 8 * GiB, 3e11, {"float32": 1e13, "bfloat16": 5e13})
    hw = HardwareSpec("mine", Level("cpu", 64 * GiB, 4e10, {"float32": 1e12}), gpu, 1, Link(1.2e10, 1.1e10))
    p = hw.save(tmp_path / "sub" / "hw.json")
    assert HardwareSpec.load(p) == hw
    assert get_hardware(str(p)) == hw
    assert get_hardware("profile", profile_path=p) == hw
    cpu_only = HardwareSpec("c", Level("cpu", 1e9, 1e10, {"float32": 1e11}))
    assert HardwareSpec.load(cpu_only.save(tmp_path / "c.json")) == cpu_only


def test_hardware_errors(tmp_path):
    with pytest.raises(KeyError, match="valid: .*s1"):
        get_hardware("v100")
    with pytest.raises(FileNotFoundError, match="nope.json"):
        HardwareSpec.load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError):
        HardwareSpec.load(bad)
    with pytest.raises(KeyError):
        Level("x", 1, 1, {"float16": 1.0}).peak_flops("bfloat16")


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.update(link_shared="false"), "link_shared must be true or false"),
    (lambda d: d.update(gpu_count=2.7), "gpu_count must be a whole number"),
    (lambda d: d.update(interconnect="fast"), "interconnect must be a non-negative number"),
    (lambda d: d["gpu"].update(gemm_flops={"float16": [[1, -5e12], [64, 1e13]]}), "gpu.gemm_flops.float16"),
    (lambda d: d["gpu"].update(gemm_flops={"float16": "fast"}), "gpu.gemm_flops.float16"),
    (lambda d: d["cpu"].update(expert_gemm_flops={"int8": [[16, 1e12], [4, 1e12]]}), "cpu.expert_gemm_flops.int8"),
    (lambda d: d["cpu"].update(attention_flops={"float32": "lots"}), "cpu.attention_flops.float32"),
    (lambda d: d.update(gpus=4), "unknown field.s. gpus; the fields are"),  # was ignored: 1 GPU planned
    (lambda d: d["link"].update(h2d_bw=1e10), "unknown field.s. link.h2d_bw"),
    # a dtype key the planner never looks up (was a KeyError traceback at plan time)
    (lambda d: d["gpu"].update(flops={"fp16": 1e12}), "gpu.flops has the unknown key 'fp16' .did you mean 'float16'"),
    (lambda d: d["cpu"].update(attention_flops={"f32": 1e12}), "cpu.attention_flops has the unknown key 'f32'"),
    (lambda d: d["gpu"].update(gemm_flops={"half": [[1, 1e12]]}), "gpu.gemm_flops has the unknown key 'half'"),
    (lambda d: d["cpu"].update(expert_gemm_flops={"q4": [[1, 1e12]]}), "keys are float32, .*uint4"),
    # required fields by path (were "Level.__init__() missing 1 required positional argument")
    (lambda d: d["cpu"].pop("bandwidth"), "missing cpu.bandwidth"),
    (lambda d: d.pop("cpu"), "missing cpu "),
    (lambda d: d.pop("link"), "missing link"),
    # a rate no machine has: the plan said 0 tok/s with overflow warnings
    (lambda d: d["link"].update(h2d=1e-300), "link.h2d is 1e-300, below the floor"),
    (lambda d: d["gpu"].update(bandwidth=5.0), "gpu.bandwidth is 5.0, below the floor"),
])
def test_hardware_json_refuses_values_it_would_misread(edit, field):
    """A profile is hand-edited: a string "false" or a fractional GPU count is refused by name, not coerced."""
    gpu = Level("gpu", 8 * GiB, 3e11, {"float16": 6e13})
    d = HardwareSpec("mine", Level("cpu", 64 * GiB, 4e10, {"float32": 1e12}), gpu, 2, Link(1.2e10, 1.1e10)).to_dict()
    edit(d)
    with pytest.raises(ValueError, match=field):
        HardwareSpec.from_dict(d)


def test_hardware_file_errors_name_the_file(tmp_path):
    d = HardwareSpec("mine", Level("cpu", 64 * GiB, 4e10, {"float32": 1e12})).to_dict()
    del d["cpu"]["bandwidth"]
    (tmp_path / "hw.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"hw\.json: malformed hardware spec: missing cpu\.bandwidth"):
        HardwareSpec.load(tmp_path / "hw.json")


def test_model_from_hf_mixtral_matches_preset():
    m = model_from_hf_config(MIXTRAL_CFG, name="mixtral-8x7b")
    p = get_model("mixtral-8x7b")
    assert (m.hidden_size, m.num_layers, m.num_experts, m.top_k, m.num_kv_heads, m.head_dim) == (
        p.hidden_size, p.num_layers, p.num_experts, p.top_k, p.num_kv_heads, p.head_dim)
    assert m.total_params() == p.total_params()


def test_model_from_hf_dbrx_matches_preset(tmp_path):
    m = model_from_hf_config(DBRX_CFG)
    p = get_model("dbrx")
    assert (m.intermediate_size, m.num_experts, m.top_k, m.num_kv_heads, m.head_dim) == (10752, 16, 4, 8, 128)
    assert m.total_params() == p.total_params()
    (tmp_path / "dbrx-dir").mkdir()
    (tmp_path / "dbrx-dir" / "config.json").write_text(json.dumps(DBRX_CFG))
    assert get_model(str(tmp_path / "dbrx-dir")).num_experts == 16
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_dir(tmp_path)


def test_model_errors():
    with pytest.raises(KeyError, match="valid presets: .*mixtral-8x7b"):
        get_model("llama-7b")
    with pytest.raises(ValueError, match="model_type"):
        model_from_hf_config({"model_type": "llama"})
    with pytest.raises(ValueError, match="lacks"):
        model_from_hf_config({"model_type": "mixtral", "hidden_size": 8})


def test_small_presets():
    t, b = get_model("tiny"), get_model("bench-1b")
    assert (t.vocab_size, t.hidden_size, t.intermediate_size, t.num_layers, t.num_experts, t.top_k) == (
        512, 64, 128, 2, 4, 2)
    got = (b.hidden_size, b.num_layers, b.num_heads, b.num_kv_heads, b.max_position)
    assert got == (1024, 8, 16, 4, 4096)


def test_workload():
    w = WorkloadSpec(77, 128, 418)
    assert w.effective_prompt == 77 and w.mean_context == 77 + 64 and w.max_context == 205
    assert WorkloadSpec(77, 128, 418, padded=True).effective_prompt == 418
    with pytest.raises(ValueError):
        WorkloadSpec(100, 8, max_prompt_len=50)


def test_a_prefill_pass_is_sized_by_the_longest_prompt_mixed_lengths_or_not():
    """A small micro-batch may carry the longest prompts (the mean undercounts it), a large one about
    the mean each plus one longest; padded, every prompt is the longest."""
    mixed = WorkloadSpec(521, 8, 1501, prefill_chunk=4096)
    assert mixed.prefill_pass_tokens(1) == 1501 and mixed.prefill_pass_tokens(2) == 2 * 521 + 1501
    assert mixed.prefill_pass_tokens(64) == 4096  # the chunk caps a pass of many
    layer_major = WorkloadSpec(77, 8, 418)
    assert layer_major.prefill_pass_tokens(1000) == 1000 * 77 + 418
    assert WorkloadSpec(77, 8, 418, padded=True).prefill_pass_tokens(1000) == 1000 * 418
    assert WorkloadSpec(521, 8, 5000, prefill_chunk=4096).prefill_pass_tokens(1) == 5000  # one prompt is one pass


def test_hrm_never_imports_torch():
    import subprocess

    code = ("import sys, hrm, hrm.costs, hrm.roofline, hrm.plots, optimizer, optimizer.search;"
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
