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

from moelight.errors import MoelightError

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
        router = d.get("router") or {}
        keywords = list((router.get("keywords") or {}).items())
        default = router.get("default")
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
    from moelight.engine.session import EngineSession
    from moelight.jobs.dataset_input import read_requests
    from moelight.jobs.output_file import LazyResultWriter, report_path
    from moelight.jobs.report import RunReport
    from moelight.jobs.serving import serve_requests

    spec = CoESpec.load(opts.model)
    if opts.coe_order not in ORDERS:
        raise CoEError(f"--coe-order {opts.coe_order!r} is not one of {', '.join(ORDERS)}")
    loaded, requests, out_format = read_requests(opts)
    problems, routed = [], []
    for r in requests:
        try:
            routed.append(spec.route(r))
        except CoEError as e:
            problems.append(str(e))
    if problems:
        raise CoEError(f"{len(problems)} request(s) cannot be routed:\n  " + "\n  ".join(problems[:20]))
    runs = schedule(routed, opts.coe_order)
    total = RunReport(model=str(opts.model), dtype=opts.dtype, requests=len(requests), batch_size=0,
                      micro_batch_size=0, skipped_requests=len(loaded.skipped))
    per_model: dict[str, dict] = {}
    with LazyResultWriter(opts, out_format) as writer:
        for name, idx in runs:
            sub = replace(opts, model=spec.models[name], output=opts.output)
            part = serve_requests(EngineSession(sub, opts.log), sub, [requests[i] for i in idx], 0, writer,
                                  on_result=lambda req, res, name=name: res | {"model": name})
            total.absorb(part)
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
    total.policy = {"coe": {"order": opts.coe_order, "switches": len(runs), "models": per_model,
                            "usage_probability": {m: routed.count(m) / max(1, len(routed)) for m in spec.models}}}
    total.save(report_path(opts.output))
    return total
