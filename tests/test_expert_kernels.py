"""The fused expert kernels against a float64 reference of the same (dequantised) weights.

Every ISA this CPU has (AMX-BF16, AVX512-BF16, AVX2) and the pure-torch fallback run the same cases:
each family's expert shape (the real per-expert widths of Qwen3-30B, OLMoE, GPT-OSS-20B and
Qwen2-57B; bench-sized Mixtral and DBRX, whose real experts are 0.35 / 0.4 GB each), every weight
format (bf16, int8, int4, fp8 with 128-wide block scales, MXFP4), GPT-OSS's clamped SwiGLU with
biases, uneven token counts per expert. The kernel computes in bf16 with float32 accumulation (the
weights and the activation rounded to bf16), so it matches the float64 reference to bf16's precision:
2% of the output's largest magnitude.
"""

from __future__ import annotations

import pytest
import torch

import cpu_kernels
from cpu_kernels import dispatch
from cpu_kernels.expert_pack import QuantMatrix, bf16_matrix, dequantize, pack_experts
from cpu_kernels.expert_quant import int4_group_for, quantize_int4, quantize_int8, random_mxfp4
from cpu_kernels.expert_reference import ActSpec, apply_act, expert_biases, quantize_activation_blocks, unpack_expert

HAS_CPP = cpu_kernels.kernel_backend() != "torch"
REL_TOL = 2e-2

# (name, experts, top-k, hidden, expert width, clamped SwiGLU with biases)
SHAPES = [
    ("mixtral-bench", 8, 2, 1024, 3584, False),
    ("dbrx-bench", 16, 4, 768, 1536, False),
    ("qwen3-30b", 9, 8, 2048, 768, False),
    ("qwen3-bench", 128, 8, 1024, 224, False),
    ("olmoe-1b-7b", 9, 8, 2048, 1024, False),
    ("qwen2-57b", 5, 4, 3584, 2560, False),
    ("gpt-oss-20b", 5, 4, 2880, 2880, True),
    ("small-clamped", 6, 2, 128, 256, True),
    ("odd-widths", 4, 2, 200, 80, True),  # h and f that are not multiples of 32: padded strips
]
SMALL = ("small-clamped", "odd-widths", "qwen3-bench")


@pytest.fixture(params=["torch", "amx", "avx512bf16", "avx512", "avx2"])
def isa(request, monkeypatch):
    name = request.param
    if name == "torch":
        monkeypatch.setitem(dispatch._state, "loaded", False)
        yield name
        return
    if not HAS_CPP:
        pytest.skip("C++ kernels unavailable")
    if torch.ops.moelight.set_isa(name) != name:
        torch.ops.moelight.set_isa("auto")
        pytest.skip(f"CPU lacks {name}")
    yield name
    torch.ops.moelight.set_isa("auto")


def _weights(e, h, f, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(e, 2 * f, h, generator=g) * 0.03, torch.randn(e, h, f, generator=g) * 0.03)


def _fp8_blocks(w: torch.Tensor) -> QuantMatrix:
    """float8 e4m3 codes with one scale per 128 x 128 block (DeepSeek-V3 style), expanded per row."""
    e, n, k = w.shape
    blocks = torch.nn.functional.pad(w, (0, -k % 128, 0, -n % 128)).view(e, -(-n // 128), 128, -(-k // 128), 128)
    s = (blocks.abs().amax(dim=(2, 4)) / 448.0).clamp(min=1e-12)  # [E, N/128, K/128]
    s_rows = s.repeat_interleave(128, dim=1)[:, :n]
    codes = (w / s_rows.repeat_interleave(128, dim=2)[..., :k]).to(torch.float8_e4m3fn).view(torch.uint8)
    return QuantMatrix("fp8", codes, s_rows.contiguous(), None, 128)


def _mxfp4(w: torch.Tensor) -> QuantMatrix:
    """Random e2m1 codes with power-of-two scales per 32 values (GPT-OSS's MXFP4), near w's scale."""
    e, n, k = w.shape
    return random_mxfp4(e, n, k, torch.Generator().manual_seed(k))


def _matrices(fmt, w13, w2):
    if fmt == "bf16":
        return bf16_matrix(w13), bf16_matrix(w2)
    if fmt == "int8":
        return quantize_int8(w13), quantize_int8(w2)
    if fmt == "int4":
        g = int4_group_for(w13.shape[2], w2.shape[2])
        return quantize_int4(w13, g), quantize_int4(w2, g)
    if fmt == "fp8":
        return _fp8_blocks(w13), _fp8_blocks(w2)
    return _mxfp4(w13), _mxfp4(w2)


def _expert(m: QuantMatrix, e: int) -> torch.Tensor:
    """Expert e's dequantised matrix [N, K] (float32): only the experts a case routes to are expanded."""
    return dequantize(m.rows(slice(e, e + 1)))[0]


def _reference(x, ids, weights, m13, m2, b13, b2, act, dtype=torch.float64):
    """Dequantize-then-matmul of the same weights, in `dtype`."""
    xd = x.to(dtype)
    out = torch.zeros(x.shape[0], m2.codes.shape[1], dtype=torch.float64)
    for e in torch.unique(ids).tolist():
        w13, w2 = _expert(m13, e).to(dtype), _expert(m2, e).to(dtype)
        f = w2.shape[1]
        tok, slot = (ids == e).nonzero(as_tuple=True)
        g = xd[tok] @ w13.T + (0 if b13 is None else b13[e].to(dtype))
        y = apply_act(g[:, :f], g[:, f:], act) @ w2.T + (0 if b2 is None else b2[e].to(dtype))
        out.index_add_(0, tok, (y * weights[tok, slot, None].to(dtype)).double())
    return out


def _routing(t, e, k, seed, skew=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    if skew:  # most tokens on few experts: uneven counts per expert
        logits[:, :2] += 4.0
    weights, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return ids, weights


_CASES: dict = {}


def _case(shape, fmt):
    key = (shape[0], fmt)
    if key not in _CASES:
        _, e, k, h, f, clamped = shape
        w13, w2 = _weights(e, h, f, seed=len(_CASES))
        m13, m2 = _matrices(fmt, w13, w2)
        b13 = torch.randn(e, 2 * f) * 0.05 if clamped else None
        b2 = torch.randn(e, h) * 0.05 if clamped else None
        _CASES[key] = (m13, m2, b13, b2, pack_experts(m13, m2, b13, b2))
    return _CASES[key]


FORMAT_SHAPES = [(s, "bf16") for s in SHAPES] + [(SHAPES[7], f) for f in ("int8", "int4", "fp8", "mxfp4")] + [
    (SHAPES[0], "int4"), (SHAPES[2], "int8"), (SHAPES[3], "int4"), (SHAPES[4], "fp8"), (SHAPES[5], "int4"),
    (SHAPES[6], "mxfp4"), (SHAPES[8], "int8")]  # int8's one scale per row over K not a multiple of 32
_REFS: dict = {}


@pytest.mark.parametrize("shape,fmt", FORMAT_SHAPES, ids=[f"{s[0]}-{f}" for s, f in FORMAT_SHAPES])
def test_expert_mix_matches_reference(isa, shape, fmt):
    name, e, k, h, f, clamped = shape
    if isa == "torch" and name not in SMALL:
        pytest.skip("the pure-torch fallback runs the small shapes (it dequantises every expert per call)")
    m13, m2, b13, b2, packed = _case(shape, fmt)
    act = ActSpec(1, 7.0, 1.702) if clamped else ActSpec()
    for t, skew in ((1, False), (19, True)):
        key = (name, fmt, t)
        if key not in _REFS:
            ids, weights = _routing(t, e, k, seed=t, skew=skew)
            x = (torch.randn(t, h, generator=torch.Generator().manual_seed(t)) * (3.0 if clamped else 1.0))
            x = x.to(torch.bfloat16)
            dtype = torch.float64 if name in SMALL else torch.float32
            _REFS[key] = (x, ids, weights, _reference(x, ids, weights, m13, m2, b13, b2, act, dtype))
        x, ids, weights, ref = _REFS[key]
        got = dispatch.expert_mix(x, ids, weights, packed, act).double()
        err = (got - ref).abs().max().item() / ref.abs().max().item()
        assert err < REL_TOL, f"{name} {fmt} on {isa}, {t} tokens: relative error {err:.4f}"


def test_packing_round_trips_every_format():
    """The strips hold exactly the canonical weights: unpacking gives the dequantised matrices back."""
    for fmt in ("bf16", "int8", "int4", "fp8", "mxfp4"):
        m13, m2, b13, b2, packed = _case(SHAPES[7], fmt)
        w13, w2 = dequantize(m13), dequantize(m2)
        for e in range(w13.shape[0]):
            u13, u2 = unpack_expert(packed, e)
            rounded = (lambda w: w.to(torch.bfloat16).float()) if fmt == "bf16" else (lambda w: w)
            assert torch.equal(u13, rounded(w13[e])) and torch.equal(u2, rounded(w2[e])), fmt
            c13, c2 = expert_biases(packed, e)
            assert torch.equal(c13, b13[e]) and torch.equal(c2, b2[e])


def test_all_tokens_on_one_expert_and_empty_batch(isa):
    m13, m2, b13, b2, packed = _case(SHAPES[0], "bf16")
    t = 70
    ids = torch.tensor([[3, 5]] * t)
    weights = torch.full((t, 2), 0.5)
    x = torch.randn(t, 1024).to(torch.bfloat16)
    ref = _reference(x, ids, weights, m13, m2, None, None, ActSpec())
    got = dispatch.expert_mix(x, ids, weights, packed).double()
    assert (got - ref).abs().max() / ref.abs().max() < REL_TOL
    assert dispatch.expert_mix(x[:0], ids[:0], weights[:0], packed).shape == (0, 1024)


TILE_COUNTS = [(SHAPES[7], [1, 15, 16, 17, 33, 50]), (SHAPES[8], [2, 16, 31, 49])]


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("shape,counts", TILE_COUNTS, ids=[s[0] for s, _ in TILE_COUNTS])
def test_row_counts_across_tile_groups(isa, shape, counts, fmt):
    """Experts with 1 to 50 rows (AMX: one to four groups of 16 rows in its tiles, a last pass of one
    group after pairs of groups), clamped SwiGLU with biases; odd-widths' h and f are not multiples
    of 32 (zero-padded tiles)."""
    name, *_, h, f, clamped = shape
    m13, m2, b13, b2, packed = _case(shape, fmt)
    act = ActSpec(1, 7.0, 1.702)
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(counts)])
    ids = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(8))][:, None]  # spread over the batch
    weights = torch.rand(len(ids), 1, generator=torch.Generator().manual_seed(9))
    x = (torch.randn(len(ids), h, generator=torch.Generator().manual_seed(10)) * 3.0).to(torch.bfloat16)
    ref = _reference(x, ids, weights, m13, m2, b13, b2, act)
    got = dispatch.expert_mix(x, ids, weights, packed, act).double()
    err = (got - ref).abs().max().item() / ref.abs().max().item()
    assert err < REL_TOL, f"{name} {fmt} on {isa}: relative error {err:.4f}"


def test_thread_count_leaves_the_sums_unchanged(isa):
    """Down's work items are runs of output strips sized by the thread count, each summing every
    expert in ascending order: a token's output is bitwise the same on 1 and 2 threads."""
    if isa == "torch":
        pytest.skip("the pure-torch fallback is torch's")
    _, e, k, h, f, _ = SHAPES[1]
    *_, packed = _case(SHAPES[1], "bf16")
    ids, weights = _routing(48, e, k, seed=15)
    x = torch.randn(48, h, generator=torch.Generator().manual_seed(16)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        out = {}
        for n in (1, 2):
            torch.set_num_threads(n)
            out[n] = dispatch.expert_mix(x, ids, weights, packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out[1], out[2])


@pytest.mark.parametrize("k", [1, 5, 50])
def test_topk_rows_matches_torch(isa, k):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(37, 32003, generator=g)
    x[3, 100] = x[3, 200] = x[3].max() + 1  # a tie: argmax takes the first index
    vals, idx = dispatch.topk_rows(x, k)
    ref_vals, _ = torch.topk(x, k, dim=-1)
    assert torch.equal(vals, ref_vals)
    assert torch.equal(x.gather(1, idx), vals)
    if k == 1:
        assert torch.equal(idx[:, 0], torch.argmax(x, dim=-1))


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8", "mxfp4"])
def test_few_rows_dequantised_in_registers_equal_the_scratch_path(isa, fmt, monkeypatch):
    """An expert's few decode rows take the in-register path (qgemm), many rows the dequantise-once
    path: the same bf16 weights in the same summation order, so each token's output is bitwise the
    same whichever path its batch took. (With int8 activations on, AVX2 multiplies int8 / int4
    experts' few rows on those instead: test_few_int_rows_run_on_int8_activations.)"""
    monkeypatch.setattr(dispatch, "INT8_ACTIVATIONS", False)
    if isa == "torch":
        pytest.skip("the pure-torch fallback's matmuls block by the row count: not batch-invariant")
    for shape in (SHAPES[7], SHAPES[4] if fmt == "fp8" else SHAPES[3]):  # fp8's 128-blocks need f % 128 == 0
        _, e, k, h, f, clamped = shape
        m13, m2, b13, b2, packed = _case(shape, fmt)
        act = ActSpec(1, 7.0, 1.702) if clamped else ActSpec()
        t = 12
        ids, weights = _two_experts(t)  # 12 rows each
        x = torch.randn(t, h, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
        many = dispatch.expert_mix(x, ids, weights, packed, act)
        for lo, hi in ((0, 1), (1, 3), (3, 6)):  # 1, 2 and 3 rows per expert: both paths
            few = dispatch.expert_mix(x[lo:hi], ids[lo:hi], weights[lo:hi], packed, act)
            assert torch.equal(few, many[lo:hi]), f"{shape[0]} {fmt} on {isa}, rows {lo}:{hi}"


def _rms(d: torch.Tensor) -> float:
    return d.pow(2).mean().sqrt().item()


def _two_experts(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token on experts 1 and 3: t rows each."""
    return torch.tensor([[1, 3]] * t), torch.rand(t, 2, generator=torch.Generator().manual_seed(5))


def _int_activation_reference(x, ids, weights, m13, m2, b13, b2, act):
    """The int8-activation path in float64: each expert's input and intermediate rows rounded to int8
    per block of 32 (quantize_activation_blocks), the intermediate first rounded to bf16 as the
    kernel stores it."""
    out = torch.zeros(x.shape[0], m2.codes.shape[1], dtype=torch.float64)
    for e in torch.unique(ids).tolist():
        w13, w2 = _expert(m13, e).double(), _expert(m2, e).double()
        f = w2.shape[1]
        tok, slot = (ids == e).nonzero(as_tuple=True)
        g = quantize_activation_blocks(x[tok]) @ w13.T + (0 if b13 is None else b13[e].double())
        mid = apply_act(g[:, :f], g[:, f:], act).to(torch.bfloat16)
        y = quantize_activation_blocks(mid) @ w2.T + (0 if b2 is None else b2[e].double())
        out.index_add_(0, tok, y * weights[tok, slot, None].double())
    return out


def _has_vnni() -> bool:
    try:
        return "avx512_vnni" in open("/proc/cpuinfo").read()
    except OSError:
        return False


def _int_isa(name: str) -> None:
    """Selects an ISA whose kernel multiplies int8 / int4 experts on int8 activations (AVX2; the
    AVX-512 ones with VNNI), or skips."""
    vnni = name != "avx2"
    if not HAS_CPP or torch.ops.moelight.set_isa(name) != name or (vnni and not _has_vnni()):
        torch.ops.moelight.set_isa("auto")
        pytest.skip(f"needs the {name} kernels" + (" with VNNI" if vnni else ""))


INT_CASES = [(SHAPES[7], "int8"), (SHAPES[7], "int4"), (SHAPES[3], "int4"), (SHAPES[0], "int8")]
INT_IDS = ["clamped-int8", "clamped-int4", "qwen3-int4", "mixtral-int8"]


@pytest.mark.parametrize("int_isa", ["avx2", "avx512", "avx512bf16", "amx"])
@pytest.mark.parametrize("shape,fmt", INT_CASES + [(SHAPES[7], "mxfp4"), (SHAPES[3], "mxfp4")],
                         ids=INT_IDS + ["clamped-mxfp4", "qwen3-mxfp4"])
def test_few_int_rows_run_on_int8_activations(shape, fmt, int_isa):
    """int4 experts with any number of rows, and int8 experts with up to 16 (AVX2) or any number
    (AVX512-VNNI, whose 4-k integer multiply-add beats expanding the codes at every row count), or
    both up to 20 / 16 rows (AMX, whose tiles win above), and MXFP4 experts at any number on AVX2
    (the VNNI tables keep their bf16 path): the kernel is the int8-activation computation it claims.
    It is 3-7x closer to a float64 model of that computation than to the bf16 path's reference, from
    which it departs by ~1% (root-mean-square, relative) where the bf16 path's own rounding departs by
    ~0.35%. Experts with more rows than that (AVX2's int8, AMX's) take the bf16 path: closer to its
    reference than to the model."""
    _int_isa(int_isa)
    try:
        name, e, k, h, f, clamped = shape
        m13, m2, b13, b2, packed = _case(shape, fmt)
        act = ActSpec(1, 7.0, 1.702) if clamped else ActSpec()
        # 1-2 rows per expert; up to 16 (int8's limit); 40 on each of two experts
        for t, skew in ((2, False), (8, True), (40, None)):
            ids, weights = _routing(t, e, k, seed=11, skew=skew) if skew is not None else _two_experts(t)
            assert (torch.bincount(ids.flatten()).max() <= 16) == (skew is not None)
            x = torch.randn(t, h, generator=torch.Generator().manual_seed(12)) * (3.0 if clamped else 1.0)
            x = x.to(torch.bfloat16)
            got = dispatch.expert_mix(x, ids, weights, packed, act).double()
            model = _int_activation_reference(x, ids, weights, m13, m2, b13, b2, act)
            exact = _reference(x, ids, weights, m13, m2, b13, b2, act)
            what = f"{name} {fmt}, {t} tokens"
            worst = ((got - exact).abs().max() / exact.abs().max()).item()
            assert worst < REL_TOL, f"{what}: {worst:.4f} from the dequantize-then-matmul reference"
            # root-mean-square: the model's bf16 intermediate may round a value the other way than the
            # kernel's float32 one, and an int8 code then moves by one; such rare flips stay small here
            to_model, to_exact = _rms(got - model), _rms(got - exact)
            bf16_rows = skew is None and (int_isa == "amx" or (fmt == "int8" and int_isa == "avx2"))
            if bf16_rows or (fmt == "mxfp4" and int_isa != "avx2"):
                assert to_exact < 0.5 * to_model, f"{what}: {to_exact:.5f} from bf16's, {to_model:.5f} from the model"
            else:
                assert to_model < 0.5 * to_exact, f"{what}: {to_model:.5f} from its model, {to_exact:.5f} from bf16's"
    finally:
        torch.ops.moelight.set_isa("auto")


@pytest.mark.parametrize("shape,fmt", INT_CASES, ids=INT_IDS)
def test_vnni_int8_activation_products_equal_avx2s(shape, fmt):
    """AVX512-VNNI's int8-activation products (4 k per multiply-add, int8 codes offset to unsigned)
    give AVX2's integer block sums, and the float32 steps after them run in AVX2's order: the same
    outputs bit for bit, at 1 to 16 rows per expert (uneven blocks of 4 rows), and int4 above (int8
    experts with more rows take each ISA's bf16 GEMM, whose sums differ in order)."""
    name, e, k, h, f, clamped = shape
    m13, m2, b13, b2, packed = _case(shape, fmt)
    act = ActSpec(1, 7.0, 1.702) if clamped else ActSpec()
    try:
        for t, skew in ((1, False), (7, True)) + (((40, None),) if fmt == "int4" else ()):
            ids, weights = _routing(t, e, k, seed=13, skew=skew) if skew is not None else _two_experts(t)
            x = (torch.randn(t, h, generator=torch.Generator().manual_seed(14)) * (3.0 if clamped else 1.0))
            x = x.to(torch.bfloat16)
            out = {}
            for isa in ("avx2", "avx512", "avx512bf16"):
                _int_isa(isa)
                out[isa] = dispatch.expert_mix(x, ids, weights, packed, act)
            for isa in ("avx512", "avx512bf16"):
                assert torch.equal(out["avx2"], out[isa]), f"{name} {fmt} on {isa}, {t} tokens"
    finally:
        torch.ops.moelight.set_isa("auto")
