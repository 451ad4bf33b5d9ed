"""cpu_kernels against a float64 reference: ragged decode and causal prefill, every dtype.

The same cases run on every C++ backend this CPU has (each ISA). The float64 reference is the
pure-torch fallback itself, so the fallback is checked on its own against attention written out
from its definition (softmax of scaled scores, sinks, windows, grouped heads) instead of against
itself.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import cpu_kernels
from cpu_kernels.reference import decode_attention_torch, prefill_attention_torch

TOL = {torch.float32: 2e-5, torch.bfloat16: 2.5e-2, torch.float16: 3e-3}  # abs, on O(1) outputs
HAS_CPP = cpu_kernels.kernel_backend() != "torch"


@pytest.fixture
def backend(cpp_backend):
    """The C++ ISAs: the torch fallback is the reference here (test_the_reference_is_attention)."""
    return cpp_backend


@contextlib.contextmanager
def _one_thread():
    """The float64 references are many tiny ops: one thread avoids OpenMP wake-up costs."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _decode_ref(q, k, v, offs, lens, scale):
    with _one_thread():
        return decode_attention_torch(q.double(), k.double(), v.double(), offs, lens, scale)


def _prefill_ref(q, k, v, cu, scale):
    with _one_thread():
        return prefill_attention_torch(q.double(), k.double(), v.double(), cu, scale)


def _make_cache(lens: list[int], hkv: int, d: int, dtype, shuffle: bool, gen, mag: float = 1.0):
    """Cache with gaps between sequences; regions in random order when `shuffle`."""
    order = torch.randperm(len(lens), generator=gen).tolist() if shuffle else list(range(len(lens)))
    offs = [0] * len(lens)
    pos = 3
    for b in order:
        offs[b] = pos
        pos += lens[b] + 5  # spare capacity, like the engine's pages
    k = (torch.randn(hkv, pos, d, generator=gen) * mag).to(dtype)
    v = torch.randn(hkv, pos, d, generator=gen).to(dtype)
    return k, v, torch.tensor(offs), torch.tensor(lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv", [(1, 1), (4, 1), (8, 1), (32, 4), (8, 8)])  # Hq/Hkv = 1, 4, 8
@pytest.mark.parametrize("d", [64, 128, 192])
def test_decode_matches_float64(backend, dtype, hq, hkv, d):
    gen = torch.Generator().manual_seed(hq * 131 + hkv * 7 + d)
    lens = [1, 7, 16, 17, 33, 100, 257, 1, 600]
    k, v, offs, lens_t = _make_cache(lens, hkv, d, dtype, shuffle=True, gen=gen)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    scale = d**-0.5
    out = cpu_kernels.decode_attention(q, k, v, offs, lens_t, scale)
    assert out.dtype == dtype and out.shape == q.shape
    ref = _decode_ref(q, k, v, offs, lens_t, scale)
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("b", [1, 3, 32])
def test_decode_batch_sizes_and_odd_lengths(backend, b):
    gen = torch.Generator().manual_seed(b)
    lens = torch.randint(1, 300, (b,), generator=gen).tolist()
    k, v, offs, lens_t = _make_cache(lens, 4, 64, torch.float32, shuffle=b > 1, gen=gen)
    q = torch.randn(b, 16, 64, generator=gen)
    out = cpu_kernels.decode_attention(q, k, v, offs, lens_t, 0.125)
    torch.testing.assert_close(out.double(), _decode_ref(q, k, v, offs, lens_t, 0.125), atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_long_context_large_scores(backend, dtype):
    """8192 keys with scores in the hundreds: online softmax must not overflow."""
    gen = torch.Generator().manual_seed(5)
    lens = [8192, 3001]
    k, v, offs, lens_t = _make_cache(lens, 2, 128, dtype, shuffle=True, gen=gen, mag=8.0)
    q = (torch.randn(2, 8, 128, generator=gen) * 8.0).to(dtype)
    out = cpu_kernels.decode_attention(q, k, v, offs, lens_t, 128**-0.5)
    assert torch.isfinite(out).all()
    ref = _decode_ref(q, k, v, offs, lens_t, 128**-0.5)
    # scores ~1e3: float32 rounding of the scores alone moves the output by ~1e-4
    torch.testing.assert_close(out.double(), ref, atol=max(TOL[dtype] * 2, 5e-4), rtol=0)


def test_decode_float32_query_over_bf16_cache(backend):
    gen = torch.Generator().manual_seed(11)
    k, v, offs, lens_t = _make_cache([5, 70, 300], 2, 64, torch.bfloat16, shuffle=True, gen=gen)
    q = torch.randn(3, 8, 64, generator=gen)
    out = cpu_kernels.decode_attention(q, k, v, offs, lens_t, 0.125)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _decode_ref(q, k, v, offs, lens_t, 0.125), atol=1e-4, rtol=0)


@pytest.mark.skipif(not HAS_CPP, reason="C++ kernels unavailable")
def test_decode_writes_every_output_element():
    """Runs into a NaN-filled buffer via the op's output, and the fallback path agrees."""
    gen = torch.Generator().manual_seed(3)
    lens = [1, 2, 15, 16, 17, 31, 4000]
    k, v, offs, lens_t = _make_cache(lens, 4, 128, torch.bfloat16, shuffle=True, gen=gen)
    q = torch.randn(len(lens), 16, 128, generator=gen).to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    out.copy_(torch.ops.moelight.decode_attention(q, k, v, offs, lens_t, 0.1))
    assert not torch.isnan(out).any()
    fallback = decode_attention_torch(q, k, v, offs, lens_t, 0.1)
    torch.testing.assert_close(out.float(), fallback.float(), atol=2.5e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_low_precision_query_gives_the_rounded_float32_result(backend, dtype, cache_dtype):
    """The C++ kernels read q and write the output in the model dtype (no float32 copies):
    where the arithmetic does not depend on the output dtype (float32 / f16 caches), the
    result is exactly the float32-query result rounded like Tensor.to, split-K merge (the
    2100-key sequence) included."""
    gen = torch.Generator().manual_seed(21)
    k, v, offs, lens_t = _make_cache([1, 17, 300, 2100], 2, 64, cache_dtype, shuffle=True, gen=gen)
    q = torch.randn(4, 8, 64, generator=gen).to(dtype)
    out = cpu_kernels.decode_attention(q, k, v, offs, lens_t, 0.125)
    want = cpu_kernels.decode_attention(q.float(), k, v, offs, lens_t, 0.125).to(dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    q, k, v, cu = _prefill_case([5, 70], 8, 2, 64, dtype, gen)
    k, v = k.to(cache_dtype), v.to(cache_dtype)
    out = cpu_kernels.prefill_attention(q, k, v, cu, 0.125)
    torch.testing.assert_close(out, cpu_kernels.prefill_attention(q.float(), k, v, cu, 0.125).to(dtype),
                               atol=0, rtol=0)


def test_bf16_output_error_stays_at_the_output_rounding(backend):
    """A bf16 model's decode may round P to bf16 for P.V (AVX512-BF16): the error against
    float64 must stay at the size of rounding the exact result to bf16."""
    gen = torch.Generator().manual_seed(5)
    k, v, offs, lens_t = _make_cache([1, 15, 16, 33, 700, 3001], 2, 128, torch.bfloat16, shuffle=True, gen=gen)
    q = (torch.randn(6, 16, 128, generator=gen) * 2).to(torch.bfloat16)
    out = cpu_kernels.decode_attention(q, k, v, offs, lens_t, 128**-0.5)
    ref = _decode_ref(q, k, v, offs, lens_t, 128**-0.5)
    rounding = (ref.to(torch.bfloat16).double() - ref).abs().max()
    assert (out.double() - ref).abs().max() <= 1.5 * rounding


@pytest.mark.parametrize("d", [80, 96, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_head_dims(backend, d, dtype):
    """Every head dim the C++ kernels are instantiated for, decode and prefill."""
    gen = torch.Generator().manual_seed(d)
    k, v, offs, lens_t = _make_cache([3, 40, 129], 2, d, dtype, shuffle=True, gen=gen)
    q = torch.randn(3, 8, d, generator=gen).to(dtype)
    out = cpu_kernels.decode_attention(q, k, v, offs, lens_t, d**-0.5)
    ref = _decode_ref(q, k, v, offs, lens_t, d**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=0)
    q, k, v, cu = _prefill_case([5, 70], 8, 2, d, dtype, gen)
    out = cpu_kernels.prefill_attention(q, k, v, cu, d**-0.5)
    ref = _prefill_ref(q, k, v, cu, d**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=0)


def _prefill_case(lens: list[int], hq: int, hkv: int, d: int, dtype, gen):
    tot = sum(lens)
    q = torch.randn(tot, hq, d, generator=gen).to(dtype)
    k = torch.randn(tot, hkv, d, generator=gen).to(dtype)
    v = torch.randn(tot, hkv, d, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return q, k, v, cu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv", [(1, 1), (8, 1), (16, 4), (8, 8)])
@pytest.mark.parametrize("d", [64, 128])
def test_prefill_matches_float64(backend, dtype, hq, hkv, d):
    gen = torch.Generator().manual_seed(hq + hkv + d)
    q, k, v, cu = _prefill_case([1, 17, 77, 130, 2], hq, hkv, d, dtype, gen)
    out = cpu_kernels.prefill_attention(q, k, v, cu, d**-0.5)
    assert out.dtype == dtype and out.shape == q.shape and not torch.isnan(out).any()
    ref = _prefill_ref(q, k, v, cu, d**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=0)


def test_prefill_single_long_prompt(backend):
    gen = torch.Generator().manual_seed(9)
    q, k, v, cu = _prefill_case([700], 16, 4, 64, torch.float32, gen)
    out = cpu_kernels.prefill_attention(q, k, v, cu, 0.125)
    ref = _prefill_ref(q, k, v, cu, 0.125)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_expanded_prefill_runs_the_kernel_at_width_192(backend, dtype):
    """DeepSeek's expanded prefill: q and K 128 + 64 wide, V 128 (padded to 192 for the kernel and cut
    back); the C++ path serves it rather than torch's per-sequence loop."""
    gen = torch.Generator().manual_seed(192)
    lens = [1, 33, 90, 64]
    tot = sum(lens)
    q, k = (torch.randn(tot, 16, 192, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(tot, 16, 128, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    assert cpu_kernels.dispatch._cpp_ok(q, k, k)
    out = cpu_kernels.prefill_attention(q, k, v, cu, 192**-0.5)
    assert out.dtype == dtype and out.shape == (tot, 16, 128)
    torch.testing.assert_close(out.double(), _prefill_ref(q, k, v, cu, 192**-0.5), atol=TOL[dtype], rtol=0)


@pytest.mark.skipif(not HAS_CPP, reason="C++ kernels unavailable")
def test_decode_op_releases_the_gil():
    """A Python thread keeps running while the op runs on another thread."""
    gen = torch.Generator().manual_seed(1)
    k, v, offs, lens_t = _make_cache([2048] * 32, 8, 128, torch.float32, shuffle=False, gen=gen)
    q = torch.randn(32, 32, 128, generator=gen)
    done = threading.Event()

    def worker() -> None:
        for _ in range(5):
            torch.ops.moelight.decode_attention(q, k, v, offs, lens_t, 0.1)
        done.set()

    t0 = time.perf_counter()
    th = threading.Thread(target=worker)
    th.start()
    ticks = 0
    while not done.is_set():
        ticks += 1  # pure-Python work: only progresses when the GIL is free
    th.join()
    assert ticks > 1000, f"main thread starved ({ticks} ticks in {time.perf_counter() - t0:.3f}s)"


def _attention_by_definition(q, k, v, scale, sinks=None, causal_from=None, window=None):
    """One sequence, float64, head by head: out[t, h] = sum_j softmax_j(q[t,h].k[j,h/g] * scale) v[j,h/g],
    over the keys t may see (all; up to itself from `causal_from`; the last `window`), a sink's exp
    in the denominator."""
    T, Hq, d = q.shape
    g = Hq // k.shape[1]
    out = torch.zeros(T, Hq, d, dtype=torch.float64)
    for t in range(T):
        last = k.shape[0] if causal_from is None else causal_from + t + 1
        first = 0 if window is None else max(0, last - window)
        for h in range(Hq):
            scores = [float(q[t, h].double() @ k[j, h // g].double()) * scale for j in range(first, last)]
            top = max(scores + ([float(sinks[h])] if sinks is not None else []))
            w = [pow(2.718281828459045, s - top) for s in scores]
            den = sum(w) + (pow(2.718281828459045, float(sinks[h]) - top) if sinks is not None else 0.0)
            for j, wj in zip(range(first, last), w, strict=True):
                out[t, h] += wj / den * v[j, h // g].double()
    return out


@pytest.mark.parametrize("sinks,window", [(False, None), (True, None), (True, 3), (False, 2)])
def test_the_reference_is_attention(sinks, window):
    gen = torch.Generator().manual_seed(7)
    hq, hkv, d, n = 4, 2, 8, 6
    q, k, v = (torch.randn(n, h, d, generator=gen) for h in (hq, hkv, hkv))
    sink = torch.randn(hq, generator=gen) if sinks else None
    scale = d**-0.5
    # decode: the last token's query over the sequence's keys in a [Hkv, T, d] cache at offset 2
    cache_k, cache_v = torch.zeros(hkv, n + 4, d), torch.zeros(hkv, n + 4, d)
    cache_k[:, 2:2 + n], cache_v[:, 2:2 + n] = k.transpose(0, 1), v.transpose(0, 1)
    offs, lens = torch.tensor([2]), torch.tensor([n])
    if window is not None:  # the kernels' callers narrow each sequence's block to the window
        offs, lens = offs + max(0, n - window), torch.tensor([min(n, window)])
    got = decode_attention_torch(q[-1:], cache_k, cache_v, offs, lens, scale, sink)
    want = _attention_by_definition(q[-1:], k, v, scale, sink, causal_from=n - 1, window=window)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    # prefill: causal over the prompt
    got = prefill_attention_torch(q, k, v, torch.tensor([0, n]), scale, window, sink)
    want = _attention_by_definition(q, k, v, scale, sink, causal_from=0, window=window)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_backend_name():
    assert cpu_kernels.kernel_backend() in ("torch", "cpp-amx", "cpp-avx512bf16", "cpp-avx512", "cpp-avx2")


def test_fallback_warns_exactly_once():
    """With the extension disabled both ops still work and warn once per process."""
    code = (
        "import warnings, torch, cpu_kernels\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    q = torch.randn(2, 4, 64); k = torch.randn(1, 10, 64)\n"
        "    for _ in range(3):\n"
        "        cpu_kernels.decode_attention(q, k, k, torch.tensor([0, 5]), torch.tensor([5, 5]), 0.1)\n"
        "        cpu_kernels.prefill_attention(torch.randn(5, 4, 64), torch.randn(5, 1, 64),\n"
        "                                      torch.randn(5, 1, 64), torch.tensor([0, 5]), 0.1)\n"
        "    assert cpu_kernels.kernel_backend() == 'torch'\n"
        "print(sum('pure-torch' in str(x.message) for x in w))\n"
    )
    env = {**os.environ, "MOELIGHT_CPU_KERNELS": "torch"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "1"
