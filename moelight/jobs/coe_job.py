"""A Composition-of-Experts job (CoServe, paper 003): one `moelight run` over several checkpoints
that share one device, each request served by the model it names or a router picks.

`--model coe.json` names the models and the router:

    {"models": {"code": "path/to/code-moe", "prose": "mixtral-8x7b"},
     "router": {"keywords": {"def ": "code", "import ": "code"}, "default": "prose"}}

A request's own `model` field wins; else the first keyword found in its text; else the default.
Every request is routed (and every bad one reported) before any model loads. The device holds one
model at a time, so switching models is CoServe's "expert switching": the dependency-aware
schedule groups the requests of each model and serves the groups by usage probability (the
share of requests), so every model loads once; `--coe-order fcfs` keeps the dataset's order and
switches whenever the next request names another model (the baseline). Results go to one output,
each tagged with its model; the report adds per-model figures and the number of switches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from moelight.engine.session import EngineSession
from moelight.errors import MoelightError
from moelight.jobs.dataset_input import read_requests
from moelight.jobs.output_file import LazyResultWriter, save_report
from moelight.jobs.prompts import check_prompts, prompt_error
from moelight.jobs.report import RunReport
from moelight.jobs.serving import describe_output, serve_requests
from moelight.loading.presets import PRESETS

ORDERS = ("grouped", "fcfs")


class CoEError(MoelightError):
    """A CoE spec or a routing that cannot work; the message names the file or the request."""


@dataclass
class CoESpec:
    models: dict[str, str]
    keywords: list[tuple[str, str]]
    default: str | None

    @classmethod
    def load(cls, path: str | Path) -> CoESpec:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CoEError(f"{path}: not a CoE spec ({e})") from None
        models = d.get("models") if isinstance(d, dict) else None
        if not isinstance(models, dict) or not models or not all(isinstance(v, str) for v in models.values()):
            raise CoEError(f'{path}: needs "models": {{"name": "model folder or preset", ...}}')
        unknown_keys = sorted(set(d) - {"models", "router"})
        router = d.get("router") or {}
        if not isinstance(router, dict):
            raise CoEError(f'{path}: "router" must be an object with "keywords" and / or "default"')
        unknown_keys += [f"router.{k}" for k in sorted(set(router) - {"keywords", "default"})]
        if unknown_keys:
            raise CoEError(f"{path}: unknown field(s) {', '.join(unknown_keys)}; a CoE spec holds \"models\" and "
                           '"router" ({"keywords": {...}, "default": ...})')
        keywords = list((router.get("keywords") or {}).items())
        blank = [repr(word) for word, _ in keywords if not isinstance(word, str) or not word.strip()]
        if blank:
            raise CoEError(f"{path}: router keyword(s) {', '.join(blank)} would match every prompt; give each "
                           "keyword some text (the router's \"default\" takes what no keyword matches)")
        default = router.get("default")
        missing = [f"{name!r}: {where}" for name, where in models.items()
                   if where not in PRESETS and not Path(where).expanduser().is_dir()]
        if missing:
            raise CoEError(f"{path}: model(s) {'; '.join(missing)} are neither a model folder nor a preset "
                           f"(presets: {', '.join(PRESETS)}); fix the entry in \"models\"")
        unknown = sorted(({m for _, m in keywords} | ({default} if default else set())) - set(models))
        if unknown:
            raise CoEError(f"{path}: the router names unknown model(s) {', '.join(unknown)}; models: "
                           f"{', '.join(models)}")
        return cls(dict(models), keywords, default)

    def route(self, request) -> str:
        named = request.meta.get("model")
        if named is not None:
            if named not in self.models:
                raise CoEError(f"{request.source or request.id}: model {named!r} is not one of "
                               f"{', '.join(self.models)}")
            return named
        text = request.text
        for word, model in self.keywords:
            if word in text:
                return model
        if self.default is None:
            raise CoEError(f"{request.source or request.id}: names no model, no router keyword matches and the "
                           "spec has no router default")
        return self.default


def schedule(models: list[str], order: str) -> list[tuple[str, list[int]]]:
    """Runs of requests (their indices) per model: grouped by usage probability, or in dataset order."""
    if order == "fcfs":
        runs: list[tuple[str, list[int]]] = []
        for i, m in enumerate(models):
            if runs and runs[-1][0] == m:
                runs[-1][1].append(i)
            else:
                runs.append((m, [i]))
        return runs
    groups: dict[str, list[int]] = {}
    for i, m in enumerate(models):
        groups.setdefault(m, []).append(i)
    return sorted(groups.items(), key=lambda g: (-len(g[1]), g[1][0]))


def run_coe_job(opts):
    """Route, schedule and serve every request; one output, one report (per-model figures inside)."""
    spec = CoESpec.load(opts.model)
    if opts.coe_order not in ORDERS:
        raise CoEError(f"--coe-order {opts.coe_order!r} is not one of {', '.join(ORDERS)}")
    job = read_requests(opts)
    problems, routed, requests = [], [], []
    for r in job.requests:
        try:
            routed.append(spec.route(r))
            requests.append(r)
        except CoEError as e:
            problems.append(str(e))
    if problems and not opts.skip_bad_lines:
        raise CoEError(f"{len(problems)} request(s) cannot be routed:\n  " + "\n  ".join(problems[:20])
                       + "\nfix them, or pass --skip-bad-lines to go on without them")
    runs = schedule(routed, opts.coe_order)
    # every model's prompts checked by its own tokenizer before the first loads; the sessions serve them after
    sessions = {} if opts.skip_bad_lines else _check_prompts(opts, spec, runs, requests)
    skipped = [*job.skipped, *problems]
    total = RunReport(model=str(opts.model), dtype=opts.dtype, requests=len(requests), batch_size=0,
                      micro_batch_size=0, skipped_requests=len(skipped), skipped=skipped)
    describe_output(total, opts, job.output)
    per_model: dict[str, dict] = {}
    failing: BaseException | None = None
    try:
        with LazyResultWriter(opts, job.out_format, job.output.record) as writer:
            for name, idx in runs:
                part = _serve_model(opts, spec, name, [requests[i] for i in idx], writer, sessions.pop(name, None))
                total.absorb(part)
                total.requests -= part.skipped_requests  # this model's prompts it could not take
                total.update_rates(wall_seconds=total.generation_seconds + total.load_seconds)
                fig = per_model.setdefault(name, {"requests": 0, "loads": 0, "load_seconds": 0.0,
                                                  "generated_tokens": 0, "generation_seconds": 0.0})
                fig["requests"] += part.requests
                fig["loads"] += 1
                fig["load_seconds"] += part.load_seconds
                fig["generated_tokens"] += part.generated_tokens
                fig["generation_seconds"] += part.generation_seconds
                if part.interrupted:
                    break
    except BaseException as e:
        failing = e
        raise
    finally:
        total.policy = {"coe": {"order": opts.coe_order, "models": per_model,
                                "switches": sum(f["loads"] for f in per_model.values()),  # loads done
                                "usage_probability": {m: routed.count(m) / max(1, len(routed)) for m in spec.models}}}
        save_report(total, opts.output, failing, opts.log)
    return total


def _check_prompts(opts, spec: CoESpec, runs, requests) -> dict[str, EngineSession]:
    """PromptError listing, for every model, the requests routed to it that it cannot take (a prompt
    too long for its context, a conversation its tokenizer cannot format): said before any model
    loads, as a single-model job says it, not when that model's turn comes. The models' sessions (config
    and tokenizer, no weights yet), by name."""
    bad, sessions = [], {}
    for name in dict.fromkeys(name for name, _ in runs):
        sub = _model_options(opts, spec, name)
        session = sessions[name] = EngineSession(sub, opts.log)
        mine = [requests[i] for n, idx in runs if n == name for i in idx]
        bad += [m for _, m in check_prompts(mine, session.tokenizer, session.config.context_length, sub,
                                            checker=session.sampling)[2]]
    if bad:
        raise prompt_error(bad)
    return sessions


def _model_options(opts, spec: CoESpec, name: str):
    """One model's options: its folder; the order of the CoE job's requests is the job's (opts), not the model's."""
    return replace(opts, model=spec.models[name], output=opts.output, coe_order="grouped")


def _serve_model(opts, spec: CoESpec, name: str, requests, writer, session: EngineSession | None = None) -> RunReport:
    """One model's run of a CoE job (on `session` where the prompt check made one): its results tagged
    with its name, its report folded by the caller."""
    sub = _model_options(opts, spec, name)
    return serve_requests(session or EngineSession(sub, opts.log), sub, requests, [], writer,
                          on_result=lambda req, res: res | {"model": name}, save=False)
