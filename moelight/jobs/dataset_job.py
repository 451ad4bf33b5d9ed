"""`moelight run`: dataset in, results streamed out, report beside them.

Order matters for losing nothing: everything that can be checked without the model
(dataset, output file, tokenization, prompt lengths, memory) is checked first; each
finished request is written and flushed before the next batch starts; Ctrl-C closes the
writer and leaves a file that `--resume` continues.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

import workloads
from moelight.engine.generation import GenerationStats, SequenceResult
from moelight.engine.options import EngineOptions, OptionError
from moelight.engine.session import EngineSession
from moelight.errors import PromptError
from moelight.jobs.report import RunReport
from moelight.parallel.rank_group import follow_torchrun
from moelight.planning.memory_check import peak_rss_bytes
from moelight.sampling.params import SamplingParams


@dataclass(kw_only=True)
class RunOptions(EngineOptions):
    """A dataset job: the engine's options plus the requests' source, their sampling and the output."""

    dataset: Path
    output: Path
    gen_len: int = 128
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
    progress: bool = True
    coe_order: str = "grouped"  # a CoE job (--model coe.json): grouped by model (CoServe) or fcfs
    ray: str | None = None  # run on Ray (moelight/ray): "local" starts a cluster, "auto" / an address connects
    ray_replicas: str = "1"  # engines (actors): a count, or MIN-MAX for an autoscaling pool
    ray_cpus_per_replica: float | None = None  # None: the cluster's CPUs shared by the pool's maximum
    ray_gpus_per_replica: float = 0.0
    log: Callable[[str], None] | None = None  # one-line notes (the plan, a fresh profile)

    def validate(self) -> None:
        """Every option, the output's extension and the dataset format included, before any reading."""
        super().validate()
        if self.resume and self.overwrite:
            raise OptionError("--resume and --overwrite contradict each other: choose one")
        if self.dataset_format is not None and self.dataset_format not in workloads.FORMATS:
            raise OptionError(f"--format {self.dataset_format!r} is not one of the valid choices: "
                              f"{', '.join(workloads.FORMATS)}")
        try:
            workloads.output_format(self.output)
        except workloads.OutputPathError as e:
            raise OptionError(f"--output {e}") from None
        if self.ray is not None:
            self._check_ray()

    def _check_ray(self) -> None:
        import importlib.util

        from moelight.jobs.coe_job import is_coe_spec
        from moelight.jobs.ray.ray_job import parse_replicas

        if importlib.util.find_spec("ray") is None:
            raise OptionError('--ray needs Ray Data: pip install -e ".[ray]" (or pip install "ray[data]")')
        parse_replicas(self.ray_replicas)
        if is_coe_spec(self.model):
            raise OptionError("--ray runs one model per replica; a CoE spec (--model coe.json) runs locally only")
        if (self.gpus or 0) > 1:
            raise OptionError(f"--ray with --gpus {self.gpus}: a replica runs on one device; give each replica "
                              "one GPU (--ray-gpus-per-replica 1) and more replicas instead")
        for option, value in (("--ray-cpus-per-replica", self.ray_cpus_per_replica),
                              ("--ray-gpus-per-replica", self.ray_gpus_per_replica)):
            if value is not None and value < 0:
                raise OptionError(f"{option} {value}: must be >= 0")


def report_path(output: Path) -> Path:
    return output.with_name(output.name + ".report.json")


def run_job(opts: RunOptions) -> RunReport | None:
    """The job; None on a torchrun rank other than 0, which serves rank 0's job and writes nothing."""
    opts.validate()
    if follow_torchrun(opts):
        return None
    from moelight.jobs.coe_job import is_coe_spec, run_coe_job

    if is_coe_spec(opts.model):  # several checkpoints, one device: moelight/coe_job.py
        return run_coe_job(opts)
    if opts.ray is not None:  # a Ray Data pipeline of engines: moelight/ray/job.py
        from moelight.jobs.ray.ray_job import run_ray_job

        return run_ray_job(opts)
    loaded, requests, out_format = read_requests(opts)
    session = EngineSession(opts, opts.log)
    with LazyResultWriter(opts, out_format) as writer:
        return serve_requests(session, opts, requests, len(loaded.skipped), writer)


def read_requests(opts: RunOptions):
    """The dataset's requests less those a resumed output already holds; the output format."""
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
    return loaded, requests, out_format


class LazyResultWriter:
    """The output's ResultWriter, opened at the first finished result: a job that fails before
    one (a model that does not load) leaves an existing output as it was."""

    def __init__(self, opts: RunOptions, out_format: str) -> None:
        self.opts, self.format, self.writer = opts, out_format, None

    def write(self, result: dict) -> None:
        if self.writer is None:
            self.writer = workloads.ResultWriter(self.opts.output, self.format, resume=self.opts.resume,
                                                 overwrite=self.opts.overwrite, model_name=self.opts.model)
            self.writer.__enter__()
        self.writer.write(result)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.writer is not None:
            self.writer.__exit__(*exc)


@dataclass
class PreparedJob:
    """A batch of requests tokenized and planned on a session, not yet generated."""

    requests: list
    prompts: list[list[int]]
    params: list[SamplingParams]
    plan: object | None  # JobPlan; None when nothing is left to generate
    report: RunReport


def prepare_requests(session: EngineSession, opts: RunOptions, requests, skipped_before: int = 0) -> PreparedJob:
    """Tokenize and plan `requests` on `session` (weights not loaded yet); bad prompts raise unless skipped."""
    prompts, params, skipped = _prepare(requests, session.tokenizer, session.config.max_position_embeddings, opts)
    requests = [r for r in requests if r.id not in skipped]
    n_skipped = skipped_before + len(skipped)
    if not requests:  # e.g. --resume on a finished output: nothing to plan, load or write
        return PreparedJob([], [], [], None, session.new_report(None, 0, n_skipped))
    plan = session.plan(prompts, params, opts.turn)
    return PreparedJob(requests, prompts, params, plan, session.new_report(plan, len(requests), n_skipped))


def generate_prepared(session: EngineSession, opts: RunOptions, job: PreparedJob, writer, bar=None,
                      on_result=None) -> None:
    """Load (once per session), build the plan's engine and generate every round, writing each result."""
    t0 = time.perf_counter()
    engine = session.engine(job.plan, job.prompts, job.params, opts.turn)
    job.report.load_seconds = time.perf_counter() - t0
    _generate_rounds(engine, session.tokenizer, job.requests, job.prompts, job.params, opts, job.plan.batch_size,
                     job.plan.micro_batch_size, writer, bar, job.report, on_result)


def serve_requests(session: EngineSession, opts: RunOptions, requests, skipped_before: int, writer,
                   on_result=None) -> RunReport:
    """Tokenize, plan, load, generate and write `requests` on `session`; the report is saved beside
    the output (and returned) whatever happens, the session closed."""
    job = prepare_requests(session, opts, requests, skipped_before)
    report = job.report
    if job.plan is None:
        report.save(report_path(opts.output))
        session.close()
        return report
    total = sum(1 + len(r.followups) for r in job.requests)
    bar = tqdm(total=total, unit="req", disable=not opts.progress, desc="generating")
    try:
        generate_prepared(session, opts, job, writer, bar, on_result)
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        bar.close()
        report.cache = session.cache_stats()
        session.close()
        report.peak_memory_bytes = peak_rss_bytes()
        report.save(report_path(opts.output))
    return report


def check_prompts(requests, tokenizer, context: int, opts: RunOptions):
    """Tokenize every first turn and build its SamplingParams: (prompts, params, problems) where
    problems are (request id, message) for the requests that cannot be generated."""
    prompts, params, problems = [], [], []
    for r in requests:
        ids = tokenizer.encode_request(r)
        text_empty = not (r.prompt or r.messages)
        if text_empty or not ids:
            problems.append((r.id, f"{r.source or r.id}: empty prompt"))
        elif len(ids) >= context:
            problems.append((r.id, f"{r.source or r.id}: prompt has {len(ids)} tokens, "
                                   f"the model's context is {context}"))
        else:
            prompts.append(ids)
            params.append(SamplingParams(
                max_tokens=min(r.max_new_tokens or opts.gen_len, context - len(ids)),
                temperature=opts.temperature if r.temperature is None else r.temperature,
                top_p=opts.top_p if r.top_p is None else r.top_p,
                top_k=opts.top_k if r.top_k is None else r.top_k,
                seed=r.seed if r.seed is not None else opts.seed + zlib.crc32(r.id.encode()),
                ignore_eos=opts.ignore_eos,
            ))
    return prompts, params, problems


def prompt_error(problems: list[str]) -> PromptError:
    """Every bad prompt in one error (the first 20 listed), as a local run and a Ray run report them."""
    more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
    shown = "\n  ".join(problems[:20]) + more
    return PromptError(f"{len(problems)} request(s) cannot be generated:\n  {shown}\n"
                       "fix them, or pass --skip-bad-lines to go on without them")


def _prepare(requests, tokenizer, context: int, opts: RunOptions):
    """check_prompts, raising for bad prompts unless --skip-bad-lines; (prompts, params, skipped ids)."""
    prompts, params, problems = check_prompts(requests, tokenizer, context, opts)
    if problems and not opts.skip_bad_lines:
        raise prompt_error([m for _, m in problems])
    return prompts, params, {rid for rid, _ in problems}


def _generate_rounds(engine, tokenizer, requests, prompts, params, opts, batch_size, micro, writer, bar,
                     report, on_result=None):
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
                result = workloads.build_result(req, turns[i], model=opts.model)
                writer.write(on_result(req, result) if on_result else result)
            if bar is not None:
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
            round_prompts.append(tokenizer.apply_chat_template(history, tools=req.tools))
            room = engine.model.config.max_position_embeddings - len(round_prompts[-1])
            if room < 1:
                raise PromptError(f"{req.source or req.id}: turn {k + 2} exceeds the model's context")
            params[i] = replace(params[i], max_tokens=min(params[i].max_tokens, room))
