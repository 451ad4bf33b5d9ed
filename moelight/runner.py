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
from moelight.engine import GenerationStats, SequenceResult
from moelight.engine_session import EngineSession
from moelight.errors import PromptError
from moelight.memory import peak_rss_bytes
from moelight.options import EngineOptions, OptionError
from moelight.parallel.rank_group import follow_torchrun
from moelight.report import RunReport
from moelight.sampling import SamplingParams


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


def report_path(output: Path) -> Path:
    return output.with_name(output.name + ".report.json")


def run_job(opts: RunOptions) -> RunReport | None:
    """The job; None on a torchrun rank other than 0, which serves rank 0's job and writes nothing."""
    opts.validate()
    if follow_torchrun(opts):
        return None
    from moelight.coe_job import is_coe_spec, run_coe_job

    if is_coe_spec(opts.model):  # several checkpoints, one device: moelight/coe_job.py
        return run_coe_job(opts)
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


def serve_requests(session: EngineSession, opts: RunOptions, requests, skipped_before: int, writer,
                   on_result=None) -> RunReport:
    """Tokenize, plan, load, generate and write `requests` on `session`; the report is saved beside
    the output (and returned) whatever happens, the session closed."""
    prompts, params, skipped = _prepare(requests, session.tokenizer, session.config.max_position_embeddings, opts)
    requests = [r for r in requests if r.id not in skipped]
    n_skipped = skipped_before + len(skipped)
    if not requests:  # e.g. --resume on a finished output: nothing to plan, load or write
        report = session.new_report(None, 0, n_skipped)
        report.save(report_path(opts.output))
        session.close()
        return report
    plan = session.plan(prompts, params, opts.turn)
    report = session.new_report(plan, len(requests), n_skipped)
    total = sum(1 + len(r.followups) for r in requests)
    bar = tqdm(total=total, unit="req", disable=not opts.progress, desc="generating")
    try:
        t0 = time.perf_counter()
        engine = session.engine(plan, prompts, params, opts.turn)
        report.load_seconds = time.perf_counter() - t0
        _generate_rounds(engine, session.tokenizer, requests, prompts, params, opts, plan.batch_size,
                         plan.micro_batch_size, writer, bar, report, on_result)
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        bar.close()
        report.cache = session.cache_stats()
        session.close()
        report.peak_memory_bytes = peak_rss_bytes()
        report.save(report_path(opts.output))
    return report


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
