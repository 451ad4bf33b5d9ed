"""`--prompt-len`, `--gen-len`, `--max-prompt-len`, `--padded`, `--prefill-chunk`, `--shared-prefix` of
`plan` and `simulate` as the HRM's workload, each bad value named by its option, and a job longer than the
model's context refused: `run` would refuse such prompts, so a plan for them would be for nothing."""

from __future__ import annotations

from dataclasses import replace

import typer

PREFILL_CHUNK_OPTION = typer.Option(
    4096, "--prefill-chunk", min=0,
    help="tokens per prefill pass, each streaming the paged weights: moelight run's --max-prefill-tokens "
         "(and its default); 0: layer-major prefill, weights once per batch (the paper's)")
SHARED_PREFIX_OPTION = typer.Option(
    0.0, "--shared-prefix", min=0.0,
    help="prompt tokens per request (a mean) served by a shared prefix: what run measures on a dataset "
         "with prefix caching on (its report's policy.workload.shared_prefix). The KV pool is counted as the "
         "engine's paged pool with one prefix of that many tokens that every request shares, held once per "
         "batch (many distinct prefixes, e.g. n samples of each prompt, hold more: plan from the dataset with "
         "run for those)")


def workload_from_options(mspec, prompt_len: float, gen_len: int, max_prompt_len: int | None, padded: bool,
                          prefill_chunk: int | None, shared_prefix: float = 0.0):
    """The WorkloadSpec these options describe for the model `mspec` (an hrm ModelSpec); a prefill chunk
    of 0 (or None) is layer-major prefill."""
    from hrm import WorkloadSpec

    if not prompt_len > 0:
        raise typer.BadParameter(f"{prompt_len:g}: a mean prompt length must be > 0 tokens", param_hint="--prompt-len")
    if gen_len < 1:
        raise typer.BadParameter(f"{gen_len}: generate at least 1 token", param_hint="--gen-len")
    if max_prompt_len is not None and max_prompt_len < prompt_len:
        raise typer.BadParameter(f"{max_prompt_len}: the longest prompt cannot be shorter than the mean "
                                 f"(--prompt-len {prompt_len:g})", param_hint="--max-prompt-len")
    if padded and max_prompt_len is None:  # the HRM would pad to the mean: a no-op, not FlexGen's padding
        raise typer.BadParameter("pads every prompt to the longest: give --max-prompt-len N with it",
                                 param_hint="--padded")
    if not 0.0 <= shared_prefix <= prompt_len:
        raise typer.BadParameter(f"{shared_prefix:g}: the tokens a shared prefix serves are part of the mean "
                                 f"prompt (--prompt-len {prompt_len:g}): give 0 .. {prompt_len:g}",
                                 param_hint="--shared-prefix")
    longest = max_prompt_len if max_prompt_len is not None else prompt_len
    if longest + gen_len > mspec.max_position:
        which = ("--gen-len" if gen_len >= mspec.max_position else
                 "--max-prompt-len" if max_prompt_len is not None else "--prompt-len")
        raise typer.BadParameter(f"{longest:g} prompt tokens + --gen-len {gen_len} = {longest + gen_len:g} exceed "
                                 f"{mspec.name}'s context of {mspec.max_position} tokens; shorten one of them",
                                 param_hint=which)
    try:
        spec = WorkloadSpec(prompt_len, gen_len, max_prompt_len, padded, prefill_chunk=prefill_chunk or None,
                            shared_prefix=shared_prefix)
        return replace(spec, kv_pool_shared=shared_pool(spec)) if shared_prefix > 0 else spec
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def shared_pool(spec) -> tuple[int, int]:
    """kv_pool_shared of a WorkloadSpec given as figures with a shared prefix: the paged pool `run` would
    reserve with prefix caching on for prompts of the mean length that all begin with one prefix of
    --shared-prefix tokens (runtime/paged_layout.one_prefix_pool: its whole pages once per batch)."""
    from moelight.runtime.paged_layout import one_prefix_pool

    return one_prefix_pool(spec.effective_prompt, spec.max_context, spec.shared_prefix)


COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


def compute_dtype(dtype: str) -> str:
    """--dtype of plan / simulate, as `run` takes it: a 16- or 32-bit float (int8 / int4 are --quantize)."""
    from hrm.dtypes import canonical_dtype

    try:
        name = canonical_dtype(dtype)
    except ValueError:
        name = dtype
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"{dtype!r} is not one of auto, {', '.join(COMPUTE_DTYPES)}; integer experts are "
                         "--quantize int8 / int4")
    return name


def warn_if_busy(hw) -> None:
    """The warning `run` gives for a profile taken beside other work: it prices these plans too."""
    from moelight.profiling.host_load import busy_warning

    warning = busy_warning(hw.notes)
    if warning:
        typer.echo(warning, err=True)


def check_dtype_rates(hw, dtype: str, hardware: str, profile_path=None) -> None:
    """A hardware file whose levels lack the FLOP/s a `dtype` plan looks up is refused here, naming the
    file, before the model is read (the HRM would stop on a KeyError mid-plan)."""
    from hrm.hardware_checks import dtype_rate_problem
    from hrm.hardware_presets import DEFAULT_PROFILE_PATH

    problem = dtype_rate_problem(hw, dtype)
    if problem:
        source = hardware if hardware.lower() != "profile" else (profile_path or DEFAULT_PROFILE_PATH)
        raise typer.BadParameter(f"{source}: {problem}", param_hint="--hardware")
