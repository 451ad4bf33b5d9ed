"""The fused dequant-GEMM (models/fused_dequant.py, models/dequant_gemm_kernel.py) against the expand
path (runtime/expert_stacks.dequantize_stacks, then the matmuls), run on CPU tensors by Triton's
interpreter: every format the quantized stacks come in, group sizes 32 / 64 / 128 and a whole row,
uneven token counts with an expert that gets none, a table of two groups (resident and paged)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moelight.models import fused_dequant  # noqa: E402
from moelight.models.expert_format import ExpertFormat  # noqa: E402
from moelight.models.fused_dequant import QuantizedStack, fused_linear  # noqa: E402
from moelight.models.grouped_experts import ExpertGroup, GroupedExperts, grouped_expert_mix  # noqa: E402
from moelight.models.moe import swiglu  # noqa: E402
from moelight.models.quantized_experts import QuantizedExperts  # noqa: E402
from moelight.runtime.expert_stacks import StackLayout, dequantize_stacks  # noqa: E402

TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def _experts(fmt: str, group: int, E: int, h: int, f: int, seed: int = 0):
    """Random (gate_up, down) QuantizedExperts in `fmt` (values of std ~0.1), as a loader would hold them."""
    gen = torch.Generator().manual_seed(seed)
    form = ExpertFormat(fmt, group, zero=fmt == "uint4")
    out = []
    for n, k in ((2 * f, h), (h, f)):
        q = QuantizedExperts(form, E, n, k)
        q.fill_dummy(gen)
        with torch.no_grad():  # scales (and offsets) that differ per row and group
            q.scales.mul_(torch.rand(q.scales.shape, generator=gen) * 5 + 0.5)
            if q.offsets is not None:
                q.offsets.copy_(-8 * q.scales + torch.randn(q.offsets.shape, generator=gen) * 0.01)
        out.append(q)
    return out


def _stacks(gu: QuantizedExperts, dn: QuantizedExperts, dtype: torch.dtype, first: int, n: int):
    """Experts first .. first + n - 1 as a layout's flat buffer: (layout, views, QuantizedStacks)."""
    layout = StackLayout.quantized(n, gu, dn)
    flat = torch.zeros(layout.nbytes, dtype=torch.uint8)
    layout.fill(flat, gu, dn, first)
    views = layout.views(flat)
    fmt = layout.form.fmt
    return layout, views, (QuantizedStack.of(views, "gate_up", fmt, layout.group[0], dtype),
                           QuantizedStack.of(views, "down", fmt, layout.group[1], dtype))


def _routing(T: int, E: int, k: int, h: int, dtype: torch.dtype, idle: int):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, h, generator=gen).to(dtype)
    logits = torch.randn(T, E, generator=gen)
    logits[:, idle] = -1e9  # this expert gets no token
    weights, experts = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return x, weights / weights.sum(-1, keepdim=True), experts


CASES = [  # fmt, group, E, h, f, T, k, resident
    ("uint4", 32, 4, 64, 96, 5, 2, 1),
    ("uint4", 64, 8, 128, 64, 37, 3, 3),
    ("uint4", 128, 5, 128, 128, 19, 2, 0),
    ("int8", 0, 6, 48, 80, 23, 2, 2),  # a whole row per scale, K not a multiple of the K tile
    ("fp8", 32, 4, 64, 64, 9, 2, 2),
    ("mxfp4", 32, 4, 64, 32, 11, 2, 4),
    ("uint4", 32, 8, 64, 64, 150, 2, 3),  # 300 rows: the taller M tiles of a prefill
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# every format in every dtype (the decode and its rounding); the tiling cases (group 64 / 128, no resident
# group, tall M tiles: the same in any dtype, the kernel's tiles do not depend on it) once each
MATRIX = ([(c, d) for c in (CASES[0], CASES[3], CASES[4], CASES[5]) for d in DTYPES]
          + list(zip((CASES[1], CASES[2], CASES[6]), (torch.bfloat16, torch.float16, torch.float32), strict=True)))


@pytest.mark.parametrize("fmt,group,E,h,f,T,k,resident,dtype",
                         [pytest.param(*c, d, id=f"{c[0]}-g{c[1]}-T{c[5]}-{d}") for c, d in MATRIX])
def test_fused_mix_equals_the_expand_path(monkeypatch, dtype, fmt, group, E, h, f, T, k, resident):
    gu, dn = _experts(fmt, group, E, h, f)
    x, w, e = _routing(T, E, k, h, dtype, idle=E - 2)
    dense_gu, dense_dn = torch.empty(E, 2 * f, h, dtype=dtype), torch.empty(E, h, f, dtype=dtype)
    groups = []
    for first, n in ((0, resident), (resident, E - resident)):
        layout, views, (qgu, qdn) = _stacks(gu, dn, dtype, first, n)
        if n:
            dequantize_stacks(layout, views, dense_gu[first:first + n], dense_dn[first:first + n])
        groups.append(((first, dense_gu[first:first + n], dense_dn[first:first + n]), (first, qgu, qdn)))
    dense = GroupedExperts(tuple(ExpertGroup(*d) for d, _ in groups), E)
    fused = GroupedExperts(tuple(ExpertGroup(*q) for _, q in groups), E)
    assert fused.quantized and not dense.quantized
    ref = grouped_expert_mix(x, w, e, dense, swiglu)
    got = grouped_expert_mix(x, w, e, fused, swiglu)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), ref.float(), rtol=rtol, atol=atol * float(ref.abs().max()))


def _clamped(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=0.7), up.clamp(-0.7, 0.7)
    return (up + 1) * (gate * torch.sigmoid(gate * 1.702))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_another_activation_and_biases_take_two_launches(dtype):
    """GPT-OSS's clamped SwiGLU with expert biases: not the kernel's epilogue (plain SwiGLU only), so gate_up,
    the biases and the activation in torch, then down; the same as the expand path."""
    E, h, f = 4, 64, 64
    gu, dn = _experts("mxfp4", 32, E, h, f)
    x, w, e = _routing(13, E, 2, h, dtype, idle=1)
    gen = torch.Generator().manual_seed(2)
    gb, db = torch.randn(E, 2 * f, generator=gen).to(dtype), torch.randn(E, h, generator=gen).to(dtype)
    layout, views, stacks = _stacks(gu, dn, dtype, 0, E)
    dense_gu, dense_dn = torch.empty(E, 2 * f, h, dtype=dtype), torch.empty(E, h, f, dtype=dtype)
    dequantize_stacks(layout, views, dense_gu, dense_dn)
    ref = grouped_expert_mix(x, w, e, GroupedExperts((ExpertGroup(0, dense_gu, dense_dn),), E), _clamped, gb, db)
    got = grouped_expert_mix(x, w, e, GroupedExperts((ExpertGroup(0, *stacks),), E), _clamped, gb, db)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), ref.float(), rtol=rtol, atol=atol * float(ref.abs().max()))


@pytest.mark.parametrize("fmt,group", [("uint4", 32), ("int8", 0), ("mxfp4", 32), ("fp8", 64)])
def test_fused_linear_writes_only_its_experts_rows(fmt, group):
    """One stack of experts 2..4 over rows sorted by expert 0..5: exactly their rows, each through its
    own expert's expanded matrix (QuantizedStack[e]); the other rows are left as they were."""
    gu, dn = _experts(fmt, group, 6, 64, 64)
    _, _, (qgu, _) = _stacks(gu, dn, torch.float32, 2, 3)
    counts = torch.tensor([3, 1, 4, 0, 7, 2])
    ends = counts.cumsum(0)
    starts = ends - counts
    xs = torch.randn(int(counts.sum()), 64, generator=torch.Generator().manual_seed(3))
    out = torch.full((xs.shape[0], 128), 7.0)
    fused_linear(xs, qgu, 2, starts, ends, out)
    for e in range(6):
        rows = slice(int(starts[e]), int(ends[e]))
        want = xs[rows] @ qgu[e - 2].T if 2 <= e < 5 else torch.full_like(out[rows], 7.0)
        torch.testing.assert_close(out[rows], want, rtol=1e-5, atol=1e-5)


def test_the_switch(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(fused_dequant.MODE_ENV, raising=False)
    assert not fused_dequant.use_fused(cpu, torch.bfloat16, "uint4", (64, 96), (32, 32))  # auto: the CPU expands
    monkeypatch.setenv(fused_dequant.MODE_ENV, "fused")
    assert fused_dequant.use_fused(cpu, torch.bfloat16, "uint4", (64, 96), (32, 32))
    assert not fused_dequant.use_fused(cpu, torch.bfloat16, "uint4", (72, 96), (24, 32))  # no K tile in a group
    monkeypatch.setenv(fused_dequant.MODE_ENV, "expand")
    assert not fused_dequant.use_fused(cpu, torch.bfloat16, "uint4", (64, 96), (32, 32))
    monkeypatch.setenv(fused_dequant.MODE_ENV, "fast")
    with pytest.raises(ValueError, match="auto, fused or expand"):
        fused_dequant.mode()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fmt,group,E,h,f,T,k,resident", CASES)
def test_on_a_gpu_the_compiled_kernel_equals_the_expand_path(dtype, fmt, group, E, h, f, T, k, resident):
    """CUDA: the compiled kernel (not the interpreter) against the expand path, both on the GPU; a dtype
    whose dot this GPU's Triton cannot compile (bf16 before sm80) must be refused by the probe."""
    dev = torch.device("cuda")
    if not fused_dequant.fused_supported(dev, dtype, fmt):
        assert dtype == torch.bfloat16 and torch.cuda.get_device_capability() < (8, 0), (dtype, fmt)
        pytest.skip(f"{dtype} is not fused on this GPU: the expand path runs")
    gu, dn = _experts(fmt, group, E, h, f)
    x, w, e = _routing(T, E, k, h, dtype, idle=E - 2)
    dense_gu = torch.empty(E, 2 * f, h, dtype=dtype, device=dev)
    dense_dn = torch.empty(E, h, f, dtype=dtype, device=dev)
    dense, fused = [], []
    for first, n in ((0, resident), (resident, E - resident)):
        layout, views, _ = _stacks(gu, dn, dtype, first, n)
        views = {name: v.to(dev) for name, v in views.items()}
        if n:
            dequantize_stacks(layout, views, dense_gu[first:first + n], dense_dn[first:first + n])
        dense.append(ExpertGroup(first, dense_gu[first:first + n], dense_dn[first:first + n]))
        fused.append(ExpertGroup(first, *layout.quantized_stacks(views, dtype)))
    x, w, e = x.to(dev), w.to(dev), e.to(dev)
    ref = grouped_expert_mix(x, w, e, GroupedExperts(tuple(dense), E), swiglu)
    got = grouped_expert_mix(x, w, e, GroupedExperts(tuple(fused), E), swiglu)
    rtol, atol = TOLERANCE[dtype] if dtype != torch.float32 else (1e-4, 1e-4)  # cuBLAS may use TF32 elsewhere
    torch.testing.assert_close(got.float(), ref.float(), rtol=rtol, atol=atol * float(ref.abs().max()))


@pytest.mark.parametrize("fmt", ["int8", "uint4", "fp8", "mxfp4"])
def test_the_gpu_probe_s_check_passes_in_the_interpreter(fmt):
    """The probe CUDA runs once per device, dtype and format (both kernel specialisations against torch)
    holds for a correct kernel: run here on the CPU through the interpreter."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert fused_dequant._probe(torch.device("cpu"), dtype, fmt), dtype
