"""How `plan` and `simulate` hold a model's routed experts: as `run` holds them.

Both read --model with run's loader and let the session's choice (loading/expert_storage.py) pick the
experts' form: --quantize, or a quantized checkpoint's experts as shipped. So a GPTQ or FP8 checkpoint is
priced at its own bits, and --quantize on one is refused as run refuses it.
"""

from __future__ import annotations

import typer

from moelight.cli.errors import user_errors
from moelight.engine.options import QUANTIZE, quantization
from moelight.errors import ConfigError

QUANTIZE_HELP = ("routed experts held as int8 or int4 (as `run --quantize`): the bytes they read, page over "
                 "the link and hold")


def check_quantize(quantize: str) -> None:
    if quantize not in QUANTIZE:
        raise typer.BadParameter(f"{quantize!r} is not one of {', '.join(QUANTIZE)}", param_hint="--quantize")


def held_config(folder: str, dtype: str, device: str, quantize: str, ranks: int):
    """--model's config as `run` holds it: read by run's loader, its routed experts in the form the session
    chooses, refused where run refuses it (--quantize on a checkpoint that ships quantized experts)."""
    from moelight.loading.expert_storage import with_expert_format
    from moelight.loading.model_source import DTYPES, resolve_model

    try:
        cfg = resolve_model(folder, "auto", dtype).config
    except ConfigError as e:
        raise typer.BadParameter(str(e), param_hint="--model") from None
    method, group = quantization(quantize)
    with user_errors():
        return with_expert_format(cfg, DTYPES[dtype], device, method, group, ranks, quantize)


def held_line(form, quantize: str, bits: float) -> str:
    """The experts' held form with its group size (int4's is the largest of 128 / 64 / 32 that fits the
    widths, so it is not always the one asked for) and what chose it."""
    layout = "with a scale per output channel" if form.group == 0 else f"in groups of {form.group} input channels"
    source = f"--quantize {quantize}" if quantize != "none" else form.origin
    return f"routed experts held as {form.fmt} {layout} ({source}): {bits:.2f} bits per weight"
