"""Integer- and FP8-quantized checkpoints as they ship: GPTQ, AWQ (GEMM), compressed-tensors, and FP8
with block scales in the families whose own weight map does not read them (Qwen3-FP8 style; DeepSeek's
is models/deepseek.py).

Each quantized linear layer is a group of tensors under its module's name (GPTQ `qweight`, `qzeros`,
`scales`, `g_idx`; AWQ `qweight`, `qzeros`, `scales`; compressed-tensors `weight_packed`,
`weight_scale`, `weight_zero_point`, `weight_shape` or FP8 `weight`, `weight_scale`). The loader
reads a group as the module's `weight` (loading/weights.py): as a `QuantPiece` (codes, a scale and an
additive term per row and group of K) for routed experts the run holds quantized, dequantised to
float32 for everything else (attention, shared experts, dense MLPs stay 16-bit).

Every layout is brought to one form: unsigned codes u in [0, 2^bits) and w = (u - zero) * scale,
zero and scale per (output row, group). 4-bit codes become the kernel's uint4 (offset = -zero * scale);
8-bit ones its int8 (code u - 128, offset (128 - zero) * scale). Act-order checkpoints (GPTQ
`desc_act`, compressed-tensors `actorder`) name each input column's group in `g_idx`; unless g_idx is
the plain k // group, their groups are not contiguous and the layer is dequantised at load.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moelight.errors import ConfigError, WeightsError
from moelight.models.expert_format import ExpertFormat, IntScheme
from moelight.models.fp8 import dequantize_fp8_blocks, fp8_piece
from moelight.models.quantized_experts import QuantPiece

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: nibble i of a word holds column 8c + _AWQ_ORDER[i]
_PARTS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales"),
          "pack-quantized": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
          "float-quantized": ("weight", "weight_scale"), "fp8-block": ("weight", "weight_scale_inv")}
_FLOAT = ("float-quantized", "fp8-block")
_NEEDED = {"gptq": ("qweight", "qzeros", "scales"), "awq": ("qweight", "qzeros", "scales"),
           "pack-quantized": ("weight_packed", "weight_scale"), "float-quantized": ("weight", "weight_scale"),
           "fp8-block": ("weight", "weight_scale_inv")}


def scheme_of(quant: dict, where: str) -> IntScheme | None:
    """The scheme of a GPTQ / AWQ / compressed-tensors config, None for other methods; a ConfigError
    naming the field for one moelight cannot read (checked before anything is loaded)."""
    method = quant.get("quant_method")
    if method == "gptq":
        layout = quant.get("checkpoint_format") or "gptq"
        if layout not in ("gptq", "gptq_v2"):  # marlin, bitblas...: other packings of the same codes
            raise ConfigError(f"{where}: quantization_config.checkpoint_format {layout!r} is not supported; "
                              "moelight reads GPTQ's 'gptq' and 'gptq_v2' layouts (re-save the model in one)")
        return _checked(IntScheme("gptq", "gptq", int(quant.get("bits", 4)), int(quant.get("group_size", 128)),
                                  bool(quant.get("sym", True)), bool(quant.get("desc_act", False)),
                                  layout == "gptq"), where)
    if method == "awq":
        version = str(quant.get("version", "gemm")).lower()
        if version != "gemm":
            raise ConfigError(f"{where}: AWQ version {version!r}; moelight reads AWQ's GEMM layout only")
        bits = int(quant.get("bits", quant.get("w_bit", 4)))
        if bits != 4 or not quant.get("zero_point", True):
            raise ConfigError(f"{where}: AWQ with bits {bits} and zero_point {quant.get('zero_point', True)}; "
                              "moelight reads AWQ GEMM's 4-bit weights with zero points (bits 4, zero_point true)")
        return _checked(IntScheme("awq", "awq", bits, int(quant.get("group_size", quant.get("q_group_size", 128))),
                                  False), where)
    if method == "compressed-tensors":
        return _compressed_tensors(quant, where)
    if method == "fp8":  # Qwen3-FP8 style: e4m3 weights, `weight_scale_inv` per [rows, columns] block
        block = quant.get("weight_block_size")
        if quant.get("fmt", "e4m3") != "e4m3" or not positive_pair(block):
            raise ConfigError(f"{where}: an FP8 checkpoint with fmt {quant.get('fmt')!r} and weight_block_size "
                              f"{block!r}; moelight reads e4m3 weights with [rows, columns] block scales, two "
                              "positive whole numbers")
        return IntScheme("fp8", "fp8-block", 8, int(block[1]), block=(int(block[0]), int(block[1])))
    return None


def _compressed_tensors(quant: dict, where: str) -> IntScheme:
    fmt = quant.get("format")
    groups = [g.get("weights") for g in (quant.get("config_groups") or {}).values()]
    if fmt not in ("pack-quantized", "float-quantized") or len(groups) != 1 or not groups[0]:
        raise ConfigError(f"{where}: compressed-tensors format {fmt!r} with {len(groups)} weight scheme(s); moelight "
                          "reads one pack-quantized (int4 / int8) or float-quantized (FP8) weight scheme")
    w = groups[0]
    strategy, bits = w.get("strategy"), int(w.get("num_bits", 0))
    if strategy not in ("channel", "group", "tensor", "block"):
        raise ConfigError(f"{where}: compressed-tensors weight strategy {strategy!r}: channel, group, tensor or block")
    if strategy == "group" and not (isinstance(w.get("group_size"), int) and w["group_size"] > 0):
        raise ConfigError(f"{where}: compressed-tensors weights with strategy 'group' need a positive group_size, "
                          f"got {w.get('group_size')!r}")
    if fmt == "pack-quantized" and w.get("type", "int") != "int":
        raise ConfigError(f"{where}: pack-quantized weights of type {w.get('type')!r}; moelight reads integer "
                          "(type 'int') pack-quantized weights")
    if fmt == "float-quantized":
        if w.get("type") != "float" or bits != 8:
            raise ConfigError(f"{where}: float-quantized weights of {bits} bits, type {w.get('type')!r}: FP8 only")
        if strategy == "block" and not positive_pair(w.get("block_structure")):
            raise ConfigError(f"{where}: compressed-tensors block_structure {w.get('block_structure')!r}: "
                              "[rows, columns], two positive whole numbers")
        block = tuple(int(b) for b in w.get("block_structure") or ()) if strategy == "block" else ()
        return IntScheme("compressed-tensors", fmt, 8, block[1] if block else -1, True, False, False, block)
    group = int(w["group_size"]) if strategy == "group" else -1
    act = w.get("actorder") not in (None, False, "static")
    return _checked(IntScheme("compressed-tensors", fmt, bits, group, bool(w.get("symmetric", True)), act), where)


def positive_pair(block) -> bool:
    """An FP8 weight_block_size that can be read: [rows, columns], both whole and positive."""
    return (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block))


def _checked(s: IntScheme, where: str) -> IntScheme:
    if s.bits not in (4, 8):
        raise ConfigError(f"{where}: {s.method} with {s.bits}-bit weights; moelight reads 4- and 8-bit weights")
    if s.group != -1 and (s.group <= 0 or s.group % 32):
        raise ConfigError(f"{where}: {s.method} group size {s.group}; moelight reads -1 (one per row) or a "
                          "multiple of 32")
    return s


def expert_format_of(s: IntScheme, widths: tuple[int, ...]) -> ExpertFormat | None:
    """How the run holds routed experts of such a checkpoint (None: dequantised at load)."""
    if s.act_order or (s.group != -1 and (s.group % 32 or any(w % s.group for w in widths))):
        return None
    group = 0 if s.group == -1 else s.group
    origin = f"checkpoint {s.method}"
    if s.layout in _FLOAT:
        return ExpertFormat("fp8", group, origin=origin)
    return ExpertFormat("uint4" if s.bits == 4 else "int8", group, zero=True, origin=origin)


def quantized_modules(names, s: IntScheme, where: str,
                      listed: Callable[[str], bool] = lambda m: False) -> dict[str, dict[str, str]]:
    """`module.weight` -> {part: tensor name} for every quantized module in the checkpoint's names (a
    module stored in float is read as a plain weight); a module missing a part it needs (a scale, its
    zero points) or stored quantized though `listed` (modules_to_not_convert / ignore) keeps it in float
    is a WeightsError naming both."""
    parts, modules = _PARTS[s.layout], {}
    names = set(names)
    for name in sorted(names):  # the first offender named, the same in every run
        module, _, part = name.rpartition(".")
        scale = _PARTS[s.layout][1]  # a float layout's `weight` is quantized only beside its scale
        if part in parts and (s.layout not in _FLOAT or f"{module}.{scale}" in names):
            if listed(module):
                raise WeightsError(f"{where}: {module} is kept in float by quantization_config (modules_to_not_"
                                   f"convert / ignore) but stored {s.method}-quantized ({name}); take it off "
                                   "that list, or store it in float")
            modules.setdefault(f"{module}.weight", {})[part] = name
    needed = _NEEDED[s.layout] + (("weight_zero_point",) if s.layout == "pack-quantized" and not s.sym else ())
    for weight, found in modules.items():
        missing = [p for p in needed if p not in found]
        if missing:
            raise WeightsError(f"{where}: {weight.removesuffix('.weight')} is {s.method}-quantized but has no "
                               f"{', '.join(missing)}; the checkpoint is incomplete")
    return modules


def read_module(s: IntScheme, t: dict[str, torch.Tensor]) -> QuantPiece | torch.Tensor:
    """One module's tensors -> its [N, K] weight as a QuantPiece, or dequantised float32 when its
    groups are not contiguous (act order) or it is not a 4- / 8-bit integer or FP8 layout we keep."""
    if s.layout == "float-quantized":
        return _fp8_piece(s, t["weight"], t["weight_scale"])
    if s.layout == "fp8-block":
        if t["weight"].shape[1] % s.block[1]:  # the last column block cut short: no whole groups along K
            return dequantize_fp8_blocks(t["weight"], t["weight_scale_inv"], s.block)
        return fp8_piece(t["weight"], t["weight_scale_inv"], s.block)
    u, zero, scale, g_idx = _unpacked(s, t)
    n, k = u.shape
    group = k if s.group == -1 else s.group
    _check_groups(scale.shape[1], -(-k // group), k, g_idx)
    plain = torch.arange(k) // group
    if (g_idx is not None and not torch.equal(g_idx.long(), plain)) or k % group:
        # act order, or a last group cut short (K not a multiple of the group): dequantised per column
        cols = plain if g_idx is None else g_idx.long()
        return (u.float() - zero[:, cols]) * scale[:, cols]
    if s.bits == 4:
        codes = u.to(torch.uint8)
        return QuantPiece("uint4", codes[:, 0::2] | (codes[:, 1::2] << 4), scale, -zero * scale)
    return QuantPiece("int8", (u - 128).to(torch.int8), scale, (128.0 - zero) * scale)


def _check_groups(found: int, needed: int, k: int, g_idx: torch.Tensor | None) -> None:
    """ValueError where the scales or g_idx do not fit config.json's group size (a wrong group_size would
    otherwise apply each scale to the wrong columns, silently)."""
    if found != needed:
        raise ValueError(f"scales have {found} groups per row; K={k} in config.json's group_size needs {needed}")
    if g_idx is not None and (g_idx.numel() != k or k and not 0 <= int(g_idx.min()) <= int(g_idx.max()) < found):
        raise ValueError(f"g_idx has {g_idx.numel()} entries in {int(g_idx.min()) if k else 0}.."
                         f"{int(g_idx.max()) if k else 0}; it needs K={k} group numbers in 0..{found - 1}")


def _unpacked(s: IntScheme, t: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes u int32 [N, K], zero [N, G] float32, scale [N, G] float32, g_idx or None)."""
    if s.layout == "gptq":
        u = _unpack_along(t["qweight"], s.bits, dim=0).t()  # [K / p, N] -> [K, N] -> [N, K]
        zero = _unpack_along(t["qzeros"], s.bits, dim=1).t().float() + (1.0 if s.zeros_minus_one else 0.0)
        return u.contiguous(), zero[: u.shape[0]].contiguous(), t["scales"].float().t().contiguous(), t.get("g_idx")
    if s.layout == "awq":
        order = torch.tensor(_AWQ_ORDER).argsort()  # column j of a word sits in nibble order[j]
        u = _unpack_along(t["qweight"], s.bits, dim=1, order=order).t()
        zero = _unpack_along(t["qzeros"], s.bits, dim=1, order=order).t().float()
        return u.contiguous(), zero.contiguous(), t["scales"].float().t().contiguous(), None
    offset = 1 << (s.bits - 1)  # compressed-tensors packs signed values as value + offset
    n, k = (int(d) for d in t["weight_shape"]) if "weight_shape" in t else (t["weight_packed"].shape[0], None)
    u = _unpack_along(t["weight_packed"], s.bits, dim=1)[:, :k]
    n_groups = 1 if s.group == -1 else -(-u.shape[1] // s.group)  # a last group may be cut short
    scale = t["weight_scale"].float().reshape(-1, n_groups).expand(n, n_groups).contiguous()
    if "weight_zero_point" in t and not s.sym:
        zero = _unpack_along(t["weight_zero_point"], s.bits, dim=0)[:n].float()  # zero point + offset
    else:
        zero = torch.full((n, n_groups), float(offset))
    return u, zero.reshape(n, n_groups), scale, t.get("weight_g_idx")


def _unpack_along(packed: torch.Tensor, bits: int, dim: int, order: torch.Tensor | None = None) -> torch.Tensor:
    """int32 words holding 32 / bits values each, value i at bit bits * i (or at nibble order[i]),
    expanded along `dim` -> unsigned values (int32)."""
    per = 32 // bits
    w = packed.to(torch.int32)
    slots = torch.arange(per, dtype=torch.int32) if order is None else order.to(torch.int32)
    shifts = (bits * slots).view(*([1] * w.dim()), per)
    vals = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., per]
    vals = vals.movedim(-1, dim + 1)
    shape = list(w.shape)
    shape[dim] *= per
    return vals.reshape(shape)


def _fp8_piece(s: IntScheme, weight: torch.Tensor, scale: torch.Tensor) -> QuantPiece:
    n, k = weight.shape
    if s.block:
        bo, bi = s.block
        scales = scale.float().repeat_interleave(bo, 0)[:n]
    else:  # a scale per row (channel) or one for the tensor
        scales = scale.float().reshape(-1, 1).expand(n, 1)
    return QuantPiece("fp8", weight.contiguous().view(torch.uint8), scales.contiguous())


def dequantized(piece: QuantPiece | torch.Tensor) -> torch.Tensor:
    """A QuantPiece's float32 values ([N, K]); a dense tensor as it is."""
    if isinstance(piece, torch.Tensor):
        return piece
    from cpu_kernels.expert_pack import QuantMatrix, dequantize

    group = piece.shape[-1] // piece.scales.shape[-1]
    m = QuantMatrix(piece.fmt, piece.codes.unsqueeze(0), piece.scales.unsqueeze(0),
                    None if piece.offsets is None else piece.offsets.unsqueeze(0), group)
    return dequantize(m)[0]
