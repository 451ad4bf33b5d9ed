"""`moelight run`: dataset in, results streamed out, report beside them.

Order matters for losing nothing: everything that can be checked without the model
(dataset, output file, tokenization, prompt lengths, memory) is checked first; each
finished request is written and flushed before the next batch starts; Ctrl-C closes the
writer and leaves a file that `--resume` continues.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

import workloads
from cpu_kernels import kernel_backend
from moelight.cpu_linear import pack_model
from moelight.engine import Engine, GenerationStats, SequenceResult
from moelight.errors import MoelightError, PromptError
from moelight.loader import load_model, resolve_model
from moelight.memory import check_fits, peak_rss_bytes
from moelight.report import RunReport
from moelight.sampling import SamplingParams
from moelight.tokenizer import ByteTokenizer, load_tokenizer


@dataclass
class RunOptions:
    dataset: Path
    model: str
    output: Path
    gen_len: int = 128
    dtype: str = "auto"
    load_format: str = "auto"
    batch_size: int | None = None
    micro_batch_size: int | None = None
    seed: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    ignore_eos: bool = False
    turn: int = 1
    num_requests: int | None = None
    dataset_format: str | None = None
    prompt_column: str = "prompt"
    skip_bad_lines: bool = False
    resume: bool = False
    overwrite: bool = False
    tokenizer: str = "auto"
    max_prefill_tokens: int = 4096
    progress: bool = True
    policy: str = "auto"  # "auto" (plan with the HRM) or a policy JSON (`moelight plan --save-policy`)
    hardware: str | None = None  # preset, "profile" or a JSON path; None: the cached (or a quick) profile
    gpus: int | None = None  # GPUs the plan may use (None: what the hardware spec says)
    log: Callable[[str], None] | None = None  # one-line notes (the plan, a fresh profile)
    device: str = "auto"  # cpu (plain executor), cuda or emulated (CGOPipe runtime); auto: cuda if present
    schedule: str = "cgopipe"  # the pipeline schedule on cuda/emulated: cgopipe, flexgen, flexgen-cpu, overlap-unpaged
    refill: bool = True  # refill freed KV slots with waiting requests; False: static batches of N (the paper's)


def report_path(output: Path) -> Path:
    return output.with_name(output.name + ".report.json")


def run_job(opts: RunOptions) -> RunReport:
    if opts.resume and opts.overwrite:
        raise MoelightError("--resume and --overwrite contradict each other: choose one")
    loaded = workloads.load_dataset(
        opts.dataset, opts.dataset_format, turn=opts.turn, num_requests=opts.num_requests,
        skip_bad_lines=opts.skip_bad_lines, prompt_column=opts.prompt_column,
    )
    out_format = workloads.output_format(opts.output, loaded.format)
    requests = loaded.requests
    if opts.resume and opts.output.exists():
        done = workloads.finished_ids(opts.output)
        requests = [r for r in requests if r.id not in done]
    elif opts.output.exists() and not opts.overwrite:
        raise workloads.OutputExistsError(
            f"{opts.output}: output exists; pass --resume to continue it or --overwrite to replace it"
        )
    src = resolve_model(opts.model, opts.load_format, opts.dtype)
    cfg = src.config
    tok_dir = src.model_dir if opts.tokenizer != "byte" else None
    tokenizer = load_tokenizer(tok_dir, kind="byte" if tok_dir is None else opts.tokenizer,
                               model_vocab_size=cfg.vocab_size)
    prompts, params, skipped = _prepare(requests, tokenizer, cfg.max_position_embeddings, opts)
    requests = [r for r in requests if r.id not in skipped]
    dtype_name = str(src.dtype).replace("torch.", "")
    if not requests:  # e.g. --resume on a finished output: nothing to plan, load or write
        report = RunReport(model=opts.model, dtype=dtype_name, requests=0, batch_size=0, micro_batch_size=0,
                           skipped_requests=len(loaded.skipped) + len(skipped))
        report.save(report_path(opts.output))
        return report
    device = resolve_device(opts.device)
    batch_size, micro, policy_info, prediction, policy, hw = _choose_policy(
        opts, cfg, dtype_name, prompts, params, device)
    kv_tokens = _largest_batch_tokens(prompts, params, batch_size, opts.turn)
    check_fits(cfg, src.dtype, kv_tokens)
    report = RunReport(model=opts.model, dtype=dtype_name, requests=len(requests),
                       batch_size=batch_size, micro_batch_size=micro,
                       skipped_requests=len(loaded.skipped) + len(skipped),
                       policy=policy_info, prediction=prediction)
    t0 = time.perf_counter()
    model = load_model(src, opts.seed)
    executor = None
    if device == "cpu":
        pack_model(model)
    else:
        executor = _pipeline_executor(model, policy, hw, device, opts, prompts, params, micro)
    report.load_seconds = time.perf_counter() - t0
    report.attention_backend = kernel_backend()
    # a real tokenizer may add end-of-turn ids; the byte fallback's ids mean nothing to a checkpoint
    tok_eos = () if isinstance(tokenizer, ByteTokenizer) and src.model_dir else tokenizer.eos_ids
    eos = tuple(dict.fromkeys(tuple(cfg.eos_token_ids) + tuple(sorted(tok_eos))))
    engine = Engine(model, eos, opts.max_prefill_tokens, executor=executor, refill=opts.refill)
    report.policy["device"] = device
    report.policy["batching"] = "refill" if opts.refill else "static"
    if device != "cpu":
        report.policy["schedule"] = opts.schedule
    total = sum(1 + len(r.followups) for r in requests)
    bar = tqdm(total=total, unit="req", disable=not opts.progress, desc="generating")
    try:
        with workloads.ResultWriter(opts.output, out_format, resume=opts.resume, overwrite=opts.overwrite,
                                    model_name=opts.model) as writer:
            _generate_rounds(engine, tokenizer, requests, prompts, params, opts, batch_size, micro,
                             writer, bar, report)
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        bar.close()
        report.peak_memory_bytes = peak_rss_bytes()
        report.save(report_path(opts.output))
    return report


class PlanError(MoelightError):
    """The policy cannot run: it does not fit, it cannot be read, or it needs a missing GPU."""


def resolve_hardware(name: str | None, log: Callable[[str], None] | None = None):
    """The HardwareSpec to plan with: a preset, a profile JSON, or the cached profile.

    With no cached profile, or one from an older moelight that lacks a measurement the HRM
    now uses, a quick profile (a few seconds) is taken now and cached, so the plan always
    describes this machine and the next run starts at once.
    """
    from hrm import hardware_presets

    key = name or "profile"
    cached = hardware_presets.DEFAULT_PROFILE_PATH.expanduser()
    if key.lower() == "profile" and (not cached.is_file() or _profile_is_stale(cached)):
        from moelight.hardware_profile import profile_machine

        why = "an older moelight's profile" if cached.is_file() else "no hardware profile yet"
        t0 = time.perf_counter()
        hw = profile_machine(quick=True)
        try:
            path = hw.save(cached)
            where = f"cached in {path}"
        except OSError as e:
            where = f"not cached: {e}"
        if log:
            log(f"{why}: took a quick one in {time.perf_counter() - t0:.1f} s ({where}; "
                "`moelight profile` takes a fuller one)")
        return hw
    try:
        return hardware_presets.get_hardware(key)
    except KeyError as e:
        raise PlanError(f"--hardware: {e.args[0]}") from None
    except (FileNotFoundError, ValueError) as e:
        raise PlanError(f"--hardware {key}: {e}") from None


def _profile_is_stale(path) -> bool:
    """A measured CPU level (it has a GEMM curve) without the element-wise rate: written
    before the HRM charged element-wise work, so its plans would be ~25% optimistic."""
    import json

    try:
        cpu = json.loads(path.read_text()).get("cpu", {})
    except (OSError, ValueError, AttributeError):
        return False  # let the normal load report what is wrong with it
    return bool(cpu.get("gemm_flops")) and not cpu.get("elementwise_bandwidth")


def workload_of(prompts: list[list[int]], params: list[SamplingParams]):
    """The HRM workload of a tokenized job: mean / max prompt length, mean generation length."""
    from hrm import WorkloadSpec

    lens = [len(p) for p in prompts] or [1]
    gen = math.ceil(sum(q.max_tokens for q in params) / max(1, len(params))) if params else 1
    return WorkloadSpec(sum(lens) / len(lens), max(1, gen), max(lens))


def _choose_policy(opts: RunOptions, cfg, dtype: str, prompts, params, device: str):
    """(batch size, micro-batch size, report.policy, report.prediction, policy, hardware) for this job.

    The policy is planned (auto) or read from a file, capped to the number of requests,
    then explicit --batch-size / --micro-batch-size win; the prediction is for what runs.
    """
    from hrm import model_from_hf_config
    from optimizer import InfeasibleError, Policy, fit_policy, plan, predict_job

    n_req = len(prompts)
    hw = resolve_hardware(opts.hardware, opts.log)
    if opts.gpus is not None:
        try:
            hw = hw.with_gpus(opts.gpus)
        except ValueError as e:
            raise PlanError(f"--gpus {opts.gpus}: {e}") from None
    mspec = model_from_hf_config(cfg.to_hf_dict(), name=opts.model)
    workload = workload_of(prompts, params)
    t0 = time.perf_counter()
    if opts.policy == "auto":
        try:
            planned = plan(hw, mspec, workload, dtype).policy
        except InfeasibleError as e:
            raise PlanError(f"the job does not fit: {e}") from None
        source = "auto"
    else:
        try:
            planned = replace(Policy.load(opts.policy), dtype=dtype)
        except FileNotFoundError:
            raise PlanError(f"--policy {opts.policy}: no such file") from None
        except (ValueError, TypeError, KeyError) as e:  # bad JSON, missing fields, N != mu x n_mb
            raise PlanError(f"--policy {opts.policy}: not a policy JSON ({e})") from None
        source = str(opts.policy)
    plan_s = time.perf_counter() - t0
    if (planned.attn_on_gpu or planned.ffn_on_gpu) and device == "cpu":
        _no_gpu_runtime(planned, opts.device)
    policy = fit_policy(planned, n_req)
    batch = opts.batch_size or policy.batch_size
    micro = min(opts.micro_batch_size or policy.micro_batch_size, batch)
    ran = policy.to_dict() | {"batch_size": batch, "micro_batch_size": micro,
                              "num_micro_batches": math.ceil(min(batch, n_req) / micro)}
    info = ran | {"source": source, "hardware": hw.name, "plan_seconds": plan_s,
                  "workload": workload.to_dict()}
    if ran["batch_size"] != planned.batch_size or ran["micro_batch_size"] != planned.micro_batch_size:
        info["planned"] = planned.to_dict()
    pred = predict_job(hw, mspec, workload, policy, n_req, batch, micro)
    if opts.log:
        opts.log(f"policy ({source}, {plan_s * 1e3:.0f} ms, hardware {hw.name}): batch {batch}, micro-batch "
                 f"{micro}, {_placement(policy)}; predicted {pred['end_to_end_tokens_per_s']:.1f} tok/s end-to-end, "
                 f"bound by {pred['binding']}")
    return batch, micro, info, pred, policy, hw


def _placement(policy) -> str:
    if not (policy.attn_on_gpu or policy.ffn_on_gpu):
        return "all on CPU"
    return (f"attention on {'GPU' if policy.attn_on_gpu else 'CPU'}, FFN on {'GPU' if policy.ffn_on_gpu else 'CPU'}, "
            f"r_w {policy.r_w:.3f}")


def resolve_device(name: str) -> str:
    """auto: the CGOPipe runtime on CUDA when there is a GPU, else the plain CPU executor."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda", "emulated"):
        raise PlanError(f"--device {name!r}: choose auto, cpu, cuda or emulated")
    if name == "cuda" and not torch.cuda.is_available():
        raise PlanError("--device cuda: this torch build or host has no CUDA; use --device cpu or emulated")
    return name


def _no_gpu_runtime(policy, asked: str) -> None:
    placed = (("attention", policy.attn_on_gpu), ("the MoE FFN", policy.ffn_on_gpu))
    where = " and ".join(name for name, on in placed if on)
    raise PlanError(
        f"the policy puts {where} on the GPU, but --device {asked} runs on the CPU; use --device cuda on a "
        "GPU host or --device emulated to run the CGOPipe runtime on an emulated accelerator, or plan for "
        "the CPU with --gpus 0 (or a CPU --hardware)"
    )


def _pipeline_executor(model, policy, hw, device: str, opts: RunOptions, prompts, params, micro: int):
    """The CGOPipe runtime for this job; the emulated device takes the planned GPU's memory and link."""
    from moelight.pipeline.executor import PipelineExecutor

    kwargs: dict = {}
    if device == "emulated" and hw.has_gpu:
        kwargs["device_memory"] = int(hw.gpu.memory_bytes * hw.gpu_count)
        kwargs["h2d_bandwidth"], kwargs["d2h_bandwidth"] = hw.link.h2d, hw.link.d2h
    longest = max(len(p) + q.max_tokens for p, q in zip(prompts, params, strict=False))
    return PipelineExecutor.from_policy(
        model, replace(policy, batch_size=micro, micro_batch_size=micro, num_micro_batches=1), opts.schedule,
        device=device, max_prefill_tokens=opts.max_prefill_tokens, max_prompt_len=max(len(p) for p in prompts),
        max_context=longest * (2 if opts.turn > 1 else 1), **kwargs,
    )


def _prepare(requests, tokenizer, context: int, opts: RunOptions):
    """Tokenize every first turn and build its SamplingParams; gather every bad prompt at once."""
    prompts, params, problems, skipped = [], [], [], set()
    for r in requests:
        ids = tokenizer.encode_request(r)
        text_empty = not (r.prompt or r.messages)
        if text_empty or not ids:
            problems.append(f"{r.source or r.id}: empty prompt")
        elif len(ids) >= context:
            problems.append(f"{r.source or r.id}: prompt has {len(ids)} tokens, "
                            f"the model's context is {context}")
        else:
            p = SamplingParams(
                max_tokens=min(r.max_new_tokens or opts.gen_len, context - len(ids)),
                temperature=opts.temperature if r.temperature is None else r.temperature,
                top_p=opts.top_p if r.top_p is None else r.top_p,
                top_k=opts.top_k if r.top_k is None else r.top_k,
                seed=r.seed if r.seed is not None else opts.seed + zlib.crc32(r.id.encode()),
                ignore_eos=opts.ignore_eos,
            )
            prompts.append(ids)
            params.append(p)
            continue
        skipped.add(r.id)
    if problems and not opts.skip_bad_lines:
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        shown = "\n  ".join(problems[:20]) + more
        raise PromptError(f"{len(problems)} request(s) cannot be generated:\n  {shown}\n"
                          "fix them, or pass --skip-bad-lines to go on without them")
    return prompts, params, skipped


def _largest_batch_tokens(prompts, params, batch_size: int, turn: int) -> int:
    """KV slots of the largest batch (prompt + max new tokens per sequence), with room for turn 2."""
    sizes = [len(p) + q.max_tokens for p, q in zip(prompts, params, strict=True)]
    worst = sum(sorted(sizes, reverse=True)[:batch_size])
    return worst * (2 if turn > 1 else 1)


def _generate_rounds(engine, tokenizer, requests, prompts, params, opts, batch_size, micro, writer, bar,
                     report):
    """Round k answers the k-th user turn of every request that has one."""
    turns: list[list[workloads.TurnOutput]] = [[] for _ in requests]
    messages = [list(r.messages) if r.messages is not None else None for r in requests]
    active = list(range(len(requests)))
    round_prompts = prompts
    for k in range(1 + max((len(r.followups) for r in requests), default=0)):
        last_round = {i for i in active if len(requests[i].followups) == k}

        def on_finish(res: SequenceResult, active=active, last_round=last_round, round_prompts=round_prompts,
                      k=k):
            i = active[res.index]
            req = requests[i]
            user = req.followups[k - 1] if k else None
            turns[i].append(workloads.TurnOutput(tokenizer.decode(res.token_ids), res.token_ids,
                                                 res.finish_reason, len(round_prompts[res.index]), user=user))
            if i in last_round:
                writer.write(workloads.build_result(req, turns[i], model=opts.model))
            bar.update(1)

        stats = GenerationStats()
        engine.generate(round_prompts, [params[i] for i in active], [0] * len(active), batch_size, micro,
                        on_finish=on_finish, stats=stats)
        report.add_stats(stats)
        active = [i for i in active if i not in last_round]
        round_prompts = []
        for i in active:
            req = requests[i]
            history = messages[i] if messages[i] is not None else [{"role": "user", "content": req.prompt}]
            history = history + [{"role": "assistant", "content": turns[i][-1].text},
                                 {"role": "user", "content": req.followups[k]}]
            messages[i] = history
            round_prompts.append(tokenizer.apply_chat_template(history))
            room = engine.model.config.max_position_embeddings - len(round_prompts[-1])
            if room < 1:
                raise PromptError(f"{req.source or req.id}: turn {k + 2} exceeds the model's context")
            params[i] = replace(params[i], max_tokens=min(params[i].max_tokens, room))
