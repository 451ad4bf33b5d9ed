"""Dummy quantized experts are drawn 8 bytes at a time (models/quantized_experts.random_bytes): every code value
occurs, about equally often, the same seed gives the same codes, and int8 codes stay in round-to-nearest's
symmetric range."""

from __future__ import annotations

import torch

from moelight.models.expert_format import ExpertFormat
from moelight.models.quantized_experts import QuantizedExperts, random_bytes


def _drawn(fmt: str, seed: int = 0) -> QuantizedExperts:
    ex = QuantizedExperts(ExpertFormat(fmt, 32), 4, 64, 256)
    ex.fill_dummy(torch.Generator().manual_seed(seed))
    return ex


def test_four_bit_codes_cover_every_byte_evenly_and_repeat_with_the_seed():
    a, b, c = _drawn("uint4"), _drawn("uint4"), _drawn("uint4", seed=1)
    counts = torch.bincount(a.codes.flatten().long(), minlength=256)
    assert counts.numel() == 256 and int(counts.min()) > 0
    mean = a.codes.numel() / 256
    assert float((counts.float() - mean).abs().max()) < 6 * mean**0.5  # uniform, not e.g. top bits zero
    nibbles = torch.cat((a.codes & 15, a.codes >> 4)).flatten().long()
    assert torch.bincount(nibbles, minlength=16).min() > 0.9 * nibbles.numel() / 16
    assert torch.equal(a.codes, b.codes) and not torch.equal(a.codes, c.codes)


def test_int8_codes_stay_symmetric():
    ex = _drawn("int8")
    assert int(ex.codes.min()) == -127 and int(ex.codes.max()) == 127


def test_unaligned_tensors_still_get_every_byte_value():
    t = torch.zeros(8 * 1024 + 1, dtype=torch.uint8)[1:]  # off 8-byte alignment: one draw per byte
    random_bytes(t, torch.Generator().manual_seed(0))
    assert torch.bincount(t.long(), minlength=256).min() > 0
