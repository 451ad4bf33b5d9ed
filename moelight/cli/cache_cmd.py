"""`moelight eamc` (MoE-Infinity's EAM collection from a trace) and `moelight simulate-cache`
(a trace replayed against expert-cache policies, sizes and batch sizes with HRM costs)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from moelight.cli.errors import user_errors
from moelight.expert_cache.policy_registry import POLICIES, PREFETCHING
from moelight.jobs.path_checks import check_not_replaced, check_output_dir, check_output_file

Opt = typer.Option
DEFAULT_CACHE_SIZES = "0.1,0.25,0.5,0.75"


def eamc(
    trace: Path = Opt(..., "--trace", help="a routing trace from `moelight trace`"),
    output: Path = Opt(..., "--output", help="the collection (.npz)"),
    capacity: int = Opt(128, "--capacity", min=1, help="EAMs kept (the paper keeps hundreds)"),
    seed: int = Opt(0, "--seed"),
    overwrite: bool = Opt(False, "--overwrite", help="replace an existing --output"),
) -> None:
    """Build MoE-Infinity's EAM collection: one EAM per traced request, K-means with Eq. (1)."""
    import numpy as np

    from moelight.expert_cache.eam import EAMCollection, eam_of
    from moelight.expert_cache.routing_trace import Trace, TraceError

    with user_errors():
        check_output_file(output, "--output", [("trace", trace)])
        check_not_replaced(output, overwrite)
        t = Trace.load(trace)
        if not t.requests:
            raise TraceError(f"--trace {trace}: holds no request; trace some with `moelight trace`")
        eams = np.stack([eam_of(r.experts, t.model.num_experts) for r in t.requests])
        col = EAMCollection.build(eams, capacity, seed=seed, model=t.model.name)
        col.save(output)
    typer.echo(f"{len(col.eams)} EAMs of {len(t.requests)} requests ({col.shape[0]} MoE layers x "
               f"{col.shape[1]} experts): {output}")


def simulate_cache(
    trace: Path = Opt(..., "--trace", help="a routing trace from `moelight trace`"),
    model: str = Opt(None, "--model", help="model whose costs to use (preset or folder); default: the trace's"),
    hardware: str = Opt("t4", "--hardware", help="GPU preset or profile JSON (link and GPU costs)"),
    policy: str = Opt("all", "--policy", help=f"comma-separated: {', '.join(POLICIES)}; or all (those whose file "
                      "is given: --eamc, --predictor)"),
    cache_size: str = Opt(None, "--cache-size",
                          help="comma-separated: a share of all experts (< 1) or a slot count (default: "
                               f"{DEFAULT_CACHE_SIZES}, those the model allows: at least one layer's experts)"),
    batch: str = Opt("1", "--batch", help="comma-separated sequences decoding together"),
    eamc_path: Path = Opt(None, "--eamc", help="EAM collection for moe-infinity (`moelight eamc`)"),
    predictor: list[Path] = Opt(None, "--predictor", help="promoe / duoserve / coserve file "
                                "(`moelight train-predictor`); repeat for several"),
    prefetch_per_layer: int = Opt(None, "--prefetch-per-layer", min=0,
                                  help="prefetches per layer pass in place of the policy's own budget, "
                                       "for the policies that prefetch (default: the policy's own budget, else what "
                                       "the link moves in one layer)"),
    dtype: str = Opt("float16", "--dtype", help="float16, bfloat16 or float32: the bytes an expert copy moves"),
    as_json: Path = Opt(None, "--json", help="write every result here"),
    plot: Path = Opt(None, "--plot", help="draw hit rate and latency against cache size into this folder"),
) -> None:
    """Replay a routing trace against expert-cache policies (same policy code as `moelight run --mode latency`)."""
    from hrm import get_hardware, get_model
    from hrm.hardware_checks import dtype_rate_problem
    from moelight.engine.options import OptionError
    from moelight.expert_cache.cache_simulator import simulate_cache as run
    from moelight.expert_cache.eam import EAMCollection
    from moelight.expert_cache.policy_registry import NEEDS_PREDICTOR, make_policy
    from moelight.expert_cache.predictors import Predictors
    from moelight.expert_cache.routing_trace import Trace

    with user_errors():
        if as_json is not None:
            check_output_file(as_json, "--json", [("trace", trace)])
        if plot is not None:
            check_output_dir(plot, "--plot")
        names = list(POLICIES) if policy == "all" else [p.strip() for p in policy.split(",")]
        if any(n not in POLICIES for n in names):
            raise OptionError(f"--policy {policy!r}: choose from {', '.join(POLICIES)} or all")
        if prefetch_per_layer is not None and not set(names) & set(PREFETCHING):
            raise OptionError(f"--prefetch-per-layer {prefetch_per_layer}: --policy {policy} never prefetches; drop "
                              f"the option or add a policy that prefetches: {', '.join(PREFETCHING)}")
        files = {_kind(p): p for p in predictor or []}
        _check_files_are_read(policy, names, eamc_path, files)
        t = Trace.load(trace, hidden="promoe" in names and "promoe" in files)  # ProMoE reads hidden states
        try:
            mspec = get_model(model or t.model.name)
            hw = get_hardware(hardware)
        except (KeyError, FileNotFoundError, ValueError) as e:
            raise OptionError(str(e.args[0] if isinstance(e, KeyError) else e)) from None
        if not hw.has_gpu:
            raise OptionError(f"--hardware {hardware}: {hw.name!r} has no GPU, and an expert cache lives on one; "
                              "give a GPU preset (e.g. t4) or a GPU host's profile JSON")
        dtype = _dtype(dtype)
        problem = dtype_rate_problem(hw, dtype)  # the replay prices misses and compute in it
        if problem:
            raise OptionError(f"--hardware {hardware}: {problem}")
        L, E = len(t.model.moe_layers), t.model.num_experts
        sizes = cache_sizes(cache_size, L, E)
        if cache_size is not None and any(float(s) > L * E for s in cache_size.split(",")):
            typer.echo(f"note: --cache-size {cache_size}: the model has {L * E} routed experts; a larger count is "
                       f"simulated as {L * E} slots (every expert), once")
        batches = effective_batches(batch, len(t.requests))
        eamc = EAMCollection.load(eamc_path, L, E) if eamc_path is not None else None
        preds = {k: Predictors.load(p, k, L, E, t.model.hidden_size) for k, p in files.items()}
        needs = [("moe-infinity", eamc, "--eamc FILE (`moelight eamc --trace ...`)")] + [
            (k, preds.get(k), f"--predictor FILE (`moelight train-predictor --kind {k}`)") for k in NEEDS_PREDICTOR]
        for name, have, how in needs:
            if name in names and have is None:
                if policy != "all":
                    raise OptionError(f"--policy {name} needs {how}")
                names.remove(name)
        results = []
        for b in batches:
            for slots in sizes:
                for n in names:
                    r = run(t, lambda n=n: make_policy(n, L, E, eamc, preds.get(n)), slots, hw, mspec, b,
                            prefetch_per_layer, dtype)
                    results.append(r)
                    typer.echo(format_result(r, L * E))
    if as_json is not None:
        as_json.write_text(json.dumps([r.to_dict() for r in results], indent=2))
    if plot is not None:
        from moelight.expert_cache.plots import plot_cache_sweep

        typer.echo("plots: " + ", ".join(str(p) for p in plot_cache_sweep(results, L * E, plot)))


def _kind(path: Path) -> str:
    """The kind a predictor file was trained for (its metadata)."""
    import numpy as np

    from moelight.expert_cache.predictors import PredictorError

    if not path.is_file():
        raise PredictorError(f"--predictor {path}: no such file; train one with `moelight train-predictor`")
    try:
        with np.load(path, allow_pickle=False) as z:
            return json.loads(str(z["meta"]))["kind"]
    except Exception:  # a missing or foreign file (numpy's advice, to allow pickles, does not apply)
        raise PredictorError(f"{path}: not a predictor file; train one with `moelight train-predictor --trace TRACE "
                             "--kind KIND --output FILE.npz`") from None


def train_predictor(
    trace: Path = Opt(..., "--trace", help="a routing trace (ProMoE needs `moelight trace --hidden`)"),
    kind: str = Opt(..., "--kind", help="promoe, duoserve or coserve"),
    output: Path = Opt(..., "--output", help="the predictor file (.npz)"),
    stride: int = Opt(2, "--stride", min=1, help="promoe: predict the experts this many layers ahead"),
    epochs: int = Opt(20, "--epochs", min=1),
    seed: int = Opt(0, "--seed"),
    overwrite: bool = Opt(False, "--overwrite", help="replace an existing --output"),
) -> None:
    """Train a policy's predictors (or profile, for CoServe) on nine tenths of a trace; report the accuracy
    on the other tenth (the share of a layer's chosen experts among the predicted top-k)."""
    from moelight.engine.options import OptionError
    from moelight.expert_cache.predictor_training import train_predictors
    from moelight.expert_cache.predictors import KINDS
    from moelight.expert_cache.routing_trace import Trace

    with user_errors():
        if kind not in KINDS:
            raise OptionError(f"--kind {kind!r} is not one of the valid choices: {', '.join(KINDS)}")
        check_output_file(output, "--output", [("trace", trace)])
        check_not_replaced(output, overwrite)
        t = Trace.load(trace, hidden=kind == "promoe")
        pred = train_predictors(t, kind, stride, epochs, seed)
        pred.save(output)
    what = f"{len(pred.mlps)} layer predictors, held-out accuracy {pred.accuracy:.1%}" if pred.mlps else "profile"
    typer.echo(f"{kind}: {what}: {output}")


def format_result(r, total: int) -> str:
    st, p = r.stats, r.percentiles()
    return (f"batch {r.batch:3d}  slots {r.slots:4d} ({r.slots / total:4.0%})  {r.policy:13s} hit {st.hit_rate:6.1%}  "
            f"recall {st.prefetch_recall:6.1%}  goodpred {st.good_pred:6.1%}  moved {st.fetched_bytes / 1e9:7.2f} GB  "
            f"TPOT p50 {p['p50']:8.2f} ms p90 {p['p90']:8.2f} p99 {p['p99']:8.2f}")


def _dtype(text: str) -> str:
    """--dtype as plan and simulate take it (a 16- or 32-bit float), checked before any replay."""
    from moelight.cli.workload_options import compute_dtype
    from moelight.engine.options import OptionError

    try:
        return compute_dtype(text)
    except ValueError:
        raise OptionError(f"--dtype {text!r} is not one of the valid choices: float16, bfloat16, float32") from None


def _positive_int(option: str, text: str) -> int:
    from moelight.engine.options import OptionError

    try:
        v = int(text)
    except ValueError:
        raise OptionError(f"{option} {text!r}: not an integer") from None
    if v < 1:
        raise OptionError(f"{option} {v}: must be >= 1")
    return v


def effective_batches(text: str, sequences: int) -> list[int]:
    """--batch as the batches that can decode together: a trace of n sequences never has more than n in
    flight, so a larger batch is simulated (and labelled) as n, once, with a note."""
    asked = [_positive_int("--batch", b) for b in text.split(",")]
    if any(b > sequences for b in asked):
        typer.echo(f"note: --batch {text}: the trace holds {sequences} sequence(s), so at most {sequences} decode "
                   f"together; a larger batch is simulated as batch {sequences}")
    return list(dict.fromkeys(min(b, sequences) for b in asked))


def _check_files_are_read(policy: str, names: list[str], eamc_path: Path | None, files: dict[str, Path]) -> None:
    """An --eamc or --predictor file that no named policy reads is refused, as `run` refuses it."""
    from moelight.engine.options import OptionError

    if eamc_path is not None and "moe-infinity" not in names:
        raise OptionError(f"--eamc {eamc_path}: only --policy moe-infinity reads it; --policy {policy} would leave "
                          "it unused: add moe-infinity or drop --eamc")
    unread = [f"{path} ({kind})" for kind, path in files.items() if kind not in names]
    if unread:
        raise OptionError(f"--predictor {', '.join(unread)}: --policy {policy} does not name the policy it was "
                          "trained for, and would leave it unused")


def cache_sizes(text: str | None, layers: int, experts: int) -> list[int]:
    """--cache-size as slot counts. A cache holds at least one layer's experts: the default sizes below
    that are raised to it (duplicates dropped); a size the user gave below it is an error that says so."""
    total = layers * experts
    sizes = [_slots(s, total) for s in (text or DEFAULT_CACHE_SIZES).split(",")]
    if text is None:
        return sorted({max(s, experts) for s in sizes})
    small = [s for s in sizes if s < experts]
    if small:
        from moelight.engine.options import OptionError

        raise OptionError(f"--cache-size {text}: {', '.join(map(str, small))} slot(s) cannot hold one layer's "
                          f"{experts} experts; give sizes of at least {experts} slots ({experts / total:.2f} of "
                          f"the {total} experts)")
    return list(dict.fromkeys(sizes))  # counts over the total are clamped to it: simulate it once


def _slots(text: str, total: int) -> int:
    """'0.25' -> a quarter of all experts; '40' -> 40 slots."""
    from moelight.engine.options import OptionError

    try:
        v = float(text)
    except ValueError:
        raise OptionError(f"--cache-size {text!r}: a share of the experts (e.g. 0.25) or a slot count") from None
    if v <= 0 or (v >= 1 and v != int(v)):
        raise OptionError(f"--cache-size {text!r}: a share in (0, 1) or a whole number of slots")
    return max(1, round(v * total)) if v < 1 else min(int(v), total)


def register(app: typer.Typer) -> None:
    app.command("eamc")(eamc)
    app.command("simulate-cache")(simulate_cache)
    app.command("train-predictor")(train_predictor)
