"""Serving a list of requests on a session: tokenize and check, plan, load, generate every turn,
write each result as it finishes, close the report. The local dataset job, each model of a CoE
job and each batch of a Ray replica run this; `LLM.generate` runs `generate_planned`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from tqdm import tqdm

import workloads
from moelight.engine.generation import GenerationStats, SequenceResult
from moelight.errors import PromptError
from moelight.jobs.output_file import report_path
from moelight.jobs.prompts import prepare_prompts
from moelight.jobs.report import RunReport
from moelight.sampling.params import SamplingParams


@dataclass
class PreparedJob:
    """A batch of requests tokenized and planned on a session, not yet generated."""

    requests: list
    prompts: list[list[int]]
    params: list[SamplingParams]
    plan: object | None  # JobPlan; None when nothing is left to generate
    report: RunReport


def prepare_requests(session, opts, requests, skipped_before: int = 0, solved=None) -> PreparedJob:
    """Tokenize and plan `requests` on `session` (weights not loaded yet); bad prompts raise unless
    skipped. `solved`: a policy solved already for this job (see EngineSession.plan)."""
    prompts, params, skipped = prepare_prompts(requests, session.tokenizer, session.config.max_position_embeddings,
                                               opts)
    requests = [r for r in requests if r.id not in skipped]
    n_skipped = skipped_before + len(skipped)
    if not requests:  # e.g. --resume on a finished output: nothing to plan, load or write
        return PreparedJob([], [], [], None, RunReport.for_plan(opts.model, session.dtype_name, None, 0, n_skipped))
    plan = session.plan(prompts, params, opts.turn, solved=solved)
    report = RunReport.for_plan(opts.model, session.dtype_name, plan, len(requests), n_skipped)
    return PreparedJob(requests, prompts, params, plan, report)


def generate_planned(session, plan, prompts, params, report: RunReport, turn: int = 1,
                     on_finish: Callable[[SequenceResult], None] | None = None,
                     stats: GenerationStats | None = None) -> list[SequenceResult]:
    """One round of a planned job on the plan's engine (loading the weights on the session's first
    job: that time is the report's load_seconds); the round's figures go to `stats` and `report`."""
    t0 = time.perf_counter()
    engine = session.engine(plan, prompts, params, turn)
    report.load_seconds += time.perf_counter() - t0
    stats = stats if stats is not None else GenerationStats()
    results = engine.generate(prompts, params, [0] * len(prompts), plan.batch_size, plan.micro_batch_size,
                              on_finish=on_finish, stats=stats)
    report.add_stats(stats)
    return results


def generate_prepared(session, opts, job: PreparedJob, writer, bar=None, on_result=None) -> None:
    """Generate every turn of a prepared job, writing each request's result when its last turn ends.
    Round k answers the k-th user turn of every request that has one."""
    requests, params, tokenizer = job.requests, list(job.params), session.tokenizer
    turns: list[list[workloads.TurnOutput]] = [[] for _ in requests]
    messages = [list(r.messages) if r.messages is not None else None for r in requests]
    active = list(range(len(requests)))
    round_prompts = job.prompts
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

        generate_planned(session, job.plan, round_prompts, [params[i] for i in active], job.report, opts.turn,
                         on_finish)
        active = [i for i in active if i not in last_round]
        round_prompts = []
        for i in active:
            req = requests[i]
            history = messages[i] if messages[i] is not None else [{"role": "user", "content": req.prompt}]
            history = history + [{"role": "assistant", "content": turns[i][-1].text},
                                 {"role": "user", "content": req.followups[k]}]
            messages[i] = history
            round_prompts.append(tokenizer.apply_chat_template(history, tools=req.tools))
            room = session.config.max_position_embeddings - len(round_prompts[-1])
            if room < 1:
                raise PromptError(f"{req.source or req.id}: turn {k + 2} exceeds the model's context")
            params[i] = replace(params[i], max_tokens=min(params[i].max_tokens, room))


def serve_requests(session, opts, requests, skipped_before: int, writer, on_result=None) -> RunReport:
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
        report.close(session)
        session.close()
        report.save(report_path(opts.output))
    return report
