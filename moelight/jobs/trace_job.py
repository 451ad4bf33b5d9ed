"""`moelight trace`: record the routing of a job, request by request, on the plain CPU executor.

Each request runs alone (batch 1) so every routed row belongs to one known (request, position):
the first pass of a layer is the prompt, each later one a generated token. A forward hook on
every MoE block recomputes its router on the block's input (a small h x E matmul) and keeps the
top-k experts and weights (and the input itself with `hidden`). In prefill the last layer runs
only each prompt's last token, as the engine does; the trace marks the others' experts -1 there
(not routed), so the cache simulator sees exactly the engine's demand.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np
import torch

from moelight.engine.generation import Engine
from moelight.expert_cache.routing_trace import RequestTrace, Trace, TraceModel


class RoutingRecorder:
    """Forward hooks on the MoE blocks; `take()` hands over what one request routed."""

    def __init__(self, model, hidden: bool = False) -> None:
        cfg = model.config
        self.moe_layers = [j for j in range(cfg.num_layers) if cfg.is_sparse(j)]
        self.hidden = hidden
        self.calls: dict[int, list[tuple]] = {j: [] for j in self.moe_layers}
        self.handles = [model.layers[j].mlp.register_forward_hook(self._hook(j)) for j in self.moe_layers]

    def _hook(self, j: int) -> Callable:
        def hook(module, inputs, output) -> None:
            x = inputs[0]
            weights, experts = module.route(x)
            self.calls[j].append((experts.cpu().numpy().astype(np.int16), weights.float().cpu().numpy(),
                                  x.float().cpu().numpy() if self.hidden else None))

        return hook

    def take(self, request_id: str, prompt_len: int) -> RequestTrace:
        """The calls since the last take, as one request: [tokens, MoE layers, k] arrays."""
        layers = len(self.moe_layers)
        tokens = prompt_len + len(self.calls[self.moe_layers[0]]) - 1
        k = self.calls[self.moe_layers[0]][0][0].shape[1]
        experts = np.full((tokens, layers, k), -1, np.int16)
        weights = np.zeros((tokens, layers, k), np.float32)
        hidden = None
        for i, j in enumerate(self.moe_layers):
            rows = [c for c in self.calls[j]]
            first = rows[0][0].shape[0]  # prompt tokens this layer routed in prefill (1 at the last layer)
            at = np.concatenate([np.arange(prompt_len - first, prompt_len), np.arange(prompt_len, tokens)])
            experts[at, i] = np.concatenate([r[0] for r in rows])
            weights[at, i] = np.concatenate([r[1] for r in rows])
            if self.hidden:
                h = np.concatenate([r[2] for r in rows])
                if hidden is None:
                    hidden = np.zeros((tokens, layers, h.shape[1]), np.float32)
                hidden[at, i] = h
            self.calls[j] = []
        return RequestTrace(request_id, prompt_len, experts, weights, hidden)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def trace_requests(model, eos: tuple[int, ...], ids: list[str], prompts: list[list[int]], params: list, seeds,
                   name: str, hidden: bool = False, on_request: Callable[[int], None] | None = None) -> Trace:
    """Generate each request alone on the plain executor and record its routing."""
    cfg = model.config
    rec = RoutingRecorder(model, hidden)
    engine = Engine(model, eos, max_prefill_tokens=max(len(p) for p in prompts))
    trace = Trace(TraceModel(name, cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.hidden_size, rec.moe_layers))
    try:
        with torch.inference_mode():
            for i, (rid, prompt, p, seed) in enumerate(zip(ids, prompts, params, seeds, strict=True)):
                engine.generate([prompt], [p], [seed], batch_size=1, micro_batch_size=1)
                trace.requests.append(rec.take(rid, len(prompt)))
                if on_request is not None:
                    on_request(i)
    finally:
        rec.close()
    return trace


def run_trace_job(opts, hidden: bool = False, progress: bool = True) -> Trace:
    """`moelight trace`: every request of the dataset alone on the CPU executor; the trace is saved
    to opts.output (a .parquet file) and returned."""
    from tqdm import tqdm

    import workloads
    from moelight.engine.session import EngineSession
    from moelight.jobs.prompts import expand_samples, prepare_prompts

    opts.validate()
    loaded = workloads.load_dataset(opts.dataset, opts.dataset_format, num_requests=opts.num_requests,
                                    skip_bad_lines=opts.skip_bad_lines, hint_style="cli")
    session = EngineSession(opts)
    prompts, params, skipped = prepare_prompts(loaded.requests, session.tokenizer,
                                               session.config.context_length, opts, checker=session.sampling)
    for why in skipped.values():  # --skip-bad-lines: each prompt left out, by its line
        print(f"skipped {why}", file=sys.stderr)
    ids = [r.id for r in loaded.requests if r.id not in skipped]
    many = {r for r, p in enumerate(params) if p.n > 1}
    prompts, params, owners = expand_samples(prompts, params)  # a request's n samples: a trace each, `id#k`
    ids = [f"{ids[r]}#{k}" if r in many else ids[r] for r, k in owners]
    session.load()
    bar = tqdm(total=len(ids), unit="req", disable=not progress, desc="tracing")
    try:
        result = trace_requests(session.model, session.eos, ids, prompts, params, [0] * len(ids), opts.model,
                                hidden=hidden, on_request=lambda _: bar.update(1))
    finally:
        bar.close()
    result.save(opts.output)
    return result
