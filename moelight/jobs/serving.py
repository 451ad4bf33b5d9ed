"""Serving a list of requests on a session: tokenize and check, plan, load, generate every turn,
write each result as it finishes, close the report. The local dataset job, each model of a CoE
job and each batch of a Ray replica run this; `LLM.generate` runs `generate_planned`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tqdm import tqdm

import workloads
from moelight.engine.generation import GenerationStats, SequenceResult
from moelight.errors import PromptError
from moelight.jobs.job_warnings import JobWarnings
from moelight.jobs.output_file import OutputState, report_path, save_report
from moelight.jobs.prompts import expand_samples, fit_to_context, prepare_prompts
from moelight.jobs.report import RunReport
from moelight.loading.generation_config import described, sampling_defaults
from moelight.sampling.params import SamplingParams
from moelight.tokenization.harmony import final_channel, is_harmony


@dataclass
class PreparedJob:
    """A batch of requests tokenized and planned on a session, not yet generated."""

    requests: list
    prompts: list[list[int]]
    params: list[SamplingParams]
    plan: object | None  # JobPlan; None when nothing is left to generate
    report: RunReport
    skipped: dict[str, str] = field(default_factory=dict)  # id -> why, for each bad request left out


def prepare_requests(session, opts, requests, skipped_before: list[str] = (), solved=None) -> PreparedJob:
    """Tokenize and plan `requests` on `session` (weights not loaded yet); bad prompts raise unless
    skipped. `solved`: a policy solved already for this job (see EngineSession.plan)."""
    warnings = JobWarnings()
    prompts, params, skipped = prepare_prompts(requests, session.tokenizer, session.config.context_length,
                                               opts, warnings, session.sampling)
    requests = [r for r in requests if r.id not in skipped]
    # nothing left (e.g. --resume on a finished output): nothing to plan, load or write
    seq_prompts, seq_params, _ = expand_samples(prompts, params)  # the plan holds every sample
    plan = session.plan(seq_prompts, seq_params, opts.turn, solved=solved) if requests else None
    report = RunReport.for_plan(opts.model, session.dtype_name, plan, len(requests),
                                [*skipped_before, *skipped.values()])
    report.warnings = warnings.to_dict() if warnings.counts else {}
    model_dir = getattr(getattr(getattr(session, "resolved", None), "source", None), "model_dir", None)
    suggested = sampling_defaults("auto", model_dir)
    if suggested:  # vLLM would sample with them; the CLI's own options decide here, so say so
        report.notes.append(f"{model_dir / 'generation_config.json'} suggests {described(suggested)} (vLLM's "
                            "defaults for this model); moelight run samples with its own options (greedy unless "
                            "--temperature): pass them, or set them per request, to follow it")
    return PreparedJob(requests, prompts, params, plan, report, skipped)


def generate_planned(session, plan, prompts, params, report: RunReport, turn: int = 1,
                     on_finish: Callable[[SequenceResult], None] | None = None,
                     stats: GenerationStats | None = None,
                     owners: list[tuple[int, int]] | None = None) -> list[SequenceResult]:
    """One round of a planned job on the plan's engine (loading the weights on the session's first
    job: that time is the report's load_seconds); the round's figures go to `stats` and `report`.
    `owners` (expand_samples'): the report counts a request's prompt once, whatever its n, as vLLM does
    (`stats`, the engine's, counts every sequence's)."""
    t0 = time.perf_counter()
    engine = session.engine(plan, prompts, params, turn)
    report.load_seconds += time.perf_counter() - t0
    stats = stats if stats is not None else GenerationStats()
    counted: set[int] = set()  # requests whose prompt the report holds: the first of their samples finished
    request_prompts = 0

    def finished(res: SequenceResult) -> None:
        nonlocal request_prompts
        request = owners[res.index][0] if owners is not None else res.index
        if request not in counted:
            counted.add(request)
            request_prompts += len(prompts[res.index])
        if on_finish is not None:
            on_finish(res)

    try:
        return engine.generate(prompts, params, [0] * len(prompts), plan.batch_size, plan.micro_batch_size,
                               on_finish=finished, stats=stats)
    finally:  # an interrupted round's finished sequences are in the report too
        report.add_stats(stats, prompt_tokens=request_prompts)


def first_user_turn(req: workloads.Request) -> str | None:
    """The user text the first round answers: the prompt, or the conversation's last user message."""
    if req.messages is None:
        return req.prompt
    users = [m.get("content") for m in req.messages if m.get("role") == "user"]
    return users[-1] if users and isinstance(users[-1], str) else None


def generate_prepared(session, opts, job: PreparedJob, writer, bar=None, on_result=None) -> None:
    """Generate every turn of a prepared job, writing each request's result when its last turn (and, with
    n samples, its last sample) ends. Round k answers the k-th user turn of every request that has one;
    round 0 runs every sample of a request as a sequence of its own."""
    requests, params, tokenizer = job.requests, list(job.params), session.tokenizer
    warnings = JobWarnings(**job.report.warnings) if job.report.warnings else JobWarnings()
    turns: list[list[workloads.TurnOutput]] = [[] for _ in requests]
    samples: list[list[workloads.TurnOutput | None]] = [[None] * p.n for p in params]
    prompt_lps: list[list | None] = [None] * len(requests)

    def write(i: int) -> None:
        many = samples[i] if params[i].n > 1 else None
        result = workloads.build_result(requests[i], turns[i], model=opts.model, samples=many,
                                        prompt_logprobs=prompt_lps[i])
        writer.write(on_result(requests[i], result) if on_result else result)

    messages = [list(r.messages) if r.messages is not None else None for r in requests]
    harmony = is_harmony(tokenizer)
    active = list(range(len(requests)))
    round_prompts, round_params, owners = expand_samples(job.prompts, params)
    try:
        for k in range(1 + max((len(r.followups) for r in requests), default=0)):
            last_round = {i for i in active if len(requests[i].followups) == k}

            def on_finish(res: SequenceResult, owners=owners, last_round=last_round, round_prompts=round_prompts,
                          round_params=round_params, k=k):
                i, sample = owners[res.index]
                req = requests[i]
                out = turn_output(res, round_params[res.index], len(round_prompts[res.index]), tokenizer,
                                  user=req.followups[k - 1] if k else first_user_turn(req))
                if res.prompt_logprobs is not None:
                    prompt_lps[i] = prompt_logprobs_json(res.prompt_logprobs, round_prompts[res.index],
                                                         round_params[res.index].prompt_logprobs)
                samples[i][sample] = out
                if any(s is None for s in samples[i]):
                    return  # its other samples are still running
                if bar is not None:  # a request's turn, all its samples done (the bar counts requests)
                    bar.update(1)
                turns[i].append(samples[i][0])
                if i in last_round:
                    write(i)

            generate_planned(session, job.plan, round_prompts, round_params, job.report, opts.turn, on_finish,
                             owners=owners)
            active = [i for i in active if i not in last_round]
            round_prompts, going_on = [], []
            for i in active:
                req = requests[i]
                history = messages[i] if messages[i] is not None else [{"role": "user", "content": req.prompt}]
                answer = history_answer(turns[i][-1], tokenizer, harmony, f"{req.source or req.id}: turn {k + 1}",
                                        warnings)
                history = history + [{"role": "assistant", "content": answer},
                                     {"role": "user", "content": req.followups[k]}]
                messages[i] = history
                ids = tokenizer.apply_chat_template(history, tools=req.tools, **req.chat_options)
                try:
                    params[i] = fit_to_context(f"{req.source or req.id}: turn {k + 2}", ids, params[i],
                                               session.config.context_length, warnings)
                except PromptError as e:  # the conversation ends with the turns it has: written, and said
                    warnings.add("turn_does_not_fit", str(e))
                    write(i)
                    continue
                round_prompts.append(ids)
                going_on.append(i)
                samples[i] = [None]  # later turns: one sample (n > 1 has no followups)
            active = going_on
            round_params, owners = [params[i] for i in active], [(i, 0) for i in active]
    finally:  # what was changed to make requests run, even when the job stops early
        if warnings.counts:
            job.report.warnings = warnings.to_dict()


def history_answer(turn: workloads.TurnOutput, tokenizer, harmony: bool, where: str, warnings: JobWarnings) -> str:
    """The assistant message a later turn's history holds: the answer's text, or of a harmony answer its
    final channel (what the model wrote after its last <|message|> where it has none, counted)."""
    if not harmony:
        return turn.text
    answer, final = final_channel(tokenizer.decode(turn.token_ids, skip_special_tokens=False))
    if not final:
        warnings.add("harmony_without_final", where)
    return answer


def turn_output(res: SequenceResult, p, prompt_tokens: int, tokenizer, user: str | None = None):
    """A finished sequence as the output record holds it: text (cut at a stop string by the engine),
    tokens, finish and stop reasons, and its logprobs when asked for."""
    if not p.detokenize:
        text = ""
    elif res.text is not None:
        text = res.text
    else:
        text = tokenizer.decode(res.text_token_ids(p), p.skip_special_tokens)
    extra: dict = {}
    if res.stop_reason is not None:
        extra["stop_reason"] = res.stop_reason
    if res.logprobs is not None:
        extra["logprobs"] = logprobs_json(res.logprobs, res.token_ids, p.logprobs)
        extra["cumulative_logprob"] = res.cumulative_logprob
    return workloads.TurnOutput(text, res.token_ids, res.finish_reason, prompt_tokens, user=user, extra=extra)


def _entry(token: int, lp) -> dict:
    return {"token_id": token, "token": lp.decoded_token, "logprob": lp.logprob, "rank": lp.rank}


def logprobs_json(positions: list[dict], chosen: list[int], k: int) -> list[dict]:
    """{token_id: Logprob} per position as JSON: the chosen token's entry with the top-k (`top`, by rank)."""
    out = []
    for pos, token in zip(positions, chosen, strict=False):
        top = sorted((_entry(t, lp) for t, lp in pos.items() if lp.rank <= k), key=lambda e: e["rank"])[:k]
        out.append(_entry(token, pos[token]) | {"top": top})
    return out


def prompt_logprobs_json(positions: list, prompt: list[int], k: int) -> list:
    return [None] + logprobs_json(positions[1:], prompt[1:], k)


def serve_requests(session, opts, requests, skipped_before: list[str], writer, on_result=None,
                   output: OutputState | None = None, save: bool = True,
                   refused: dict[str, str] | None = None) -> RunReport:
    """Tokenize, plan, load, generate and write `requests` on `session`; the report is saved beside
    the output (and returned) whatever happens, the session closed. `output`: what the output held
    before (a resumed job's report says so and keeps the earlier runs' reports). `refused`: custom_id ->
    why, of OpenAI records refused when the dataset was read (skipped_before lists them too)."""
    job = prepare_requests(session, opts, requests, skipped_before)
    report = job.report
    if output is not None:
        describe_output(report, opts, output)
    written_before = getattr(writer, "written", 0)
    failing: BaseException | None = None
    try:
        write_skipped_as_errors(writer, requests, job.skipped, refused or {})
        if job.plan is not None:
            total = sum(1 + len(r.followups) for r in job.requests)
            with tqdm(total=total, unit="req", disable=not opts.progress, desc="generating") as bar:
                generate_prepared(session, opts, job, writer, bar, on_result)
    except KeyboardInterrupt:
        report.interrupted = True
    except BaseException as e:
        failing = e
        raise
    finally:
        report.written = getattr(writer, "written", 0) - written_before
        report.close(session)
        session.close()
        if save:  # the report is saved after the output is closed, so it records a close that failed
            closing = close_output(writer, failing, report)
            save_report(report, opts.output, failing or closing, opts.log)
            if closing is not None and failing is None:
                raise closing
    return report


def close_output(writer, failing: BaseException | None, report: RunReport) -> BaseException | None:
    """Close the job's output (a parquet one is written then): the error it failed with, or None. A close that
    fails after the job failed is a note of the report; the job's own error is the one raised."""
    try:
        writer.close(finish=failing is None)
    except Exception as e:
        if failing is None:
            return e
        if e is not failing:  # a writer that failed says so again at close
            report.notes.append(f"the output could not be closed: {e}")
    return None


def write_skipped_as_errors(writer, requests, skipped: dict[str, str], refused: dict[str, str]) -> None:
    """An OpenAI batch output answers every request it was given: a request left out (--skip-bad-lines),
    here or when its record was read (`refused`), gets an error line under its custom_id, as OpenAI's and
    vLLM's batch runners write one (resume counts it finished: it would fail again)."""
    if getattr(writer, "format", None) != "openai":
        return
    for cid, why in refused.items():
        writer.write({"id": cid, "prompt": None, "messages": None, "meta": {},
                      "error": {"code": "invalid_request", "message": why}})
    for r in requests:
        if r.id in skipped:
            writer.write(workloads.build_error_result(r, skipped[r.id], code="invalid_request"))


def describe_output(report: RunReport, opts, output: OutputState) -> None:
    """A report that says what the output held before this run, and keeps the earlier runs' reports
    (and says how many results came from runs that saved none: killed, or out of disk)."""
    report.output = str(opts.output)
    report.already_in_output = len(output.done)
    report.notes += output.notes
    if not output.done:
        return
    if report_path(opts.output).exists():
        try:
            earlier = json.loads(report_path(opts.output).read_text())
            report.previous_runs = list(earlier.get("previous_runs", [])) + [
                {k: earlier.get(k) for k in RunReport("", "", 0, 0, 0).previous()}]
        except (OSError, ValueError, AttributeError):
            report.notes.append(f"{report_path(opts.output)} could not be read: the earlier runs are not listed")
    unreported = len(output.done) - sum(int(r.get("written") or 0) for r in report.previous_runs)
    if unreported > 0:
        report.notes.append(f"{unreported} of the {len(output.done)} results already in the output came from "
                            "runs that saved no report (killed, or out of disk space)")
