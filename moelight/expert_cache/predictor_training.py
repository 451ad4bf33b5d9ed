"""`moelight train-predictor`: fit the small predictors of ProMoE and DuoServe on a routing trace.

The trace's requests are split 9:1 (as ProMoE does); the MLPs are trained on the nine tenths
with a multi-label loss (binary cross-entropy over the experts) and their accuracy is measured on
the held-out tenth: the share of the target layer's chosen experts among the predicted top-k.
- ProMoE (paper 002, section 4): per layer l, a two-layer MLP from layer l's MoE input (the
  trace's hidden states) to the experts of layer l + stride; stride 2, the paper's stride
  prefetching (one layer further than the next, so the prediction hides behind a layer).
- DuoServe (paper 000, section 4): per layer l, an MLP from the token's expert path up to l, the
  popularity of layer l + 1 and the affinity row of layer l's experts, to layer l + 1's experts.
- CoServe needs no MLP: its file holds the routing profile (usage probabilities, dependencies).
"""

from __future__ import annotations

import numpy as np
import torch

from moelight.expert_cache.predictors import MLP, Predictors, RoutingProfile, duoserve_features
from moelight.expert_cache.routing_trace import Trace, TraceError


def _split(trace: Trace, seed: int = 0) -> tuple[list, list]:
    idx = np.random.default_rng(seed).permutation(len(trace.requests))
    n_eval = max(1, len(idx) // 10)
    return [trace.requests[i] for i in idx[n_eval:]], [trace.requests[i] for i in idx[:n_eval]]


def _examples(requests, kind: str, layer: int, stride: int, profile: RoutingProfile, E: int):
    """(inputs [N, in], multi-hot targets [N, E]) for the MLP that predicts from `layer`."""
    xs, ys = [], []
    for r in requests:
        target = r.experts[:, layer + stride]
        keep = (target[:, 0] >= 0) & (r.experts[:, layer, 0] >= 0)
        for t in np.flatnonzero(keep):
            y = np.zeros(E, np.float32)
            y[target[t]] = 1.0
            if kind == "promoe":
                xs.append(r.hidden[t, layer])
            else:
                path = np.zeros((r.experts.shape[1], E), np.float32)
                for j in range(layer + 1):
                    path[j, r.experts[t, j][r.experts[t, j] >= 0]] = 1.0
                xs.append(duoserve_features(path, layer, path[layer], profile))
            ys.append(y)
    return np.asarray(xs, np.float32), np.asarray(ys, np.float32)


def _fit(x: np.ndarray, y: np.ndarray, widths: list[int], epochs: int, seed: int) -> MLP:
    torch.manual_seed(seed)
    dims = [x.shape[1], *widths, y.shape[1]]
    layers: list[torch.nn.Module] = []
    for a, b in zip(dims[:-1], dims[1:], strict=True):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers[:-1])
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for _ in range(epochs):
        for batch in torch.randperm(len(xt)).split(256):
            opt.zero_grad(set_to_none=True)
            loss_fn(net(xt[batch]), yt[batch]).backward()
            opt.step()
    lin = [m for m in net if isinstance(m, torch.nn.Linear)]
    return MLP([(m.weight.detach().T.numpy().copy(), m.bias.detach().numpy().copy()) for m in lin])


def _top_k_accuracy(mlp: MLP, x: np.ndarray, y: np.ndarray, k: int) -> tuple[int, int]:
    if not len(x):
        return 0, 0
    top = np.argsort(-mlp(x), axis=1)[:, :k]
    return int(np.take_along_axis(y, top, 1).sum()), int(y.sum())


def train_predictors(trace: Trace, kind: str, stride: int = 2, epochs: int = 20, seed: int = 0) -> Predictors:
    m = trace.model
    L, E, k = len(m.moe_layers), m.num_experts, m.top_k
    if kind == "promoe" and any(r.hidden is None for r in trace.requests):
        raise TraceError("ProMoE's predictors read hidden states: record the trace with `moelight trace --hidden`")
    if len(trace.requests) < 2:
        raise TraceError(f"the trace holds {len(trace.requests)} request(s): training holds a tenth out (at least "
                         "one) and learns from the rest; trace more requests")
    if kind == "promoe" and stride >= L:
        raise TraceError(f"--stride {stride}: the model has {L} MoE layers, so no layer is {stride} ahead of "
                         f"another; give a stride below {L}")
    train, held = _split(trace, seed)
    profile = RoutingProfile.from_trace(Trace(m, train))
    stride = stride if kind == "promoe" else 1
    out = Predictors(kind, L, E, k, m.hidden_size, profile, stride, model=m.name)
    if kind == "coserve":
        return out
    hits = total = 0
    widths = [128] if kind == "promoe" else [64, 64]
    for layer in range(L - stride):
        x, y = _examples(train, kind, layer, stride, profile, E)
        if not len(x):
            continue
        out.mlps[layer] = _fit(x, y, widths, epochs, seed + layer)
        h, t = _top_k_accuracy(out.mlps[layer], *_examples(held, kind, layer, stride, profile, E), k)
        hits, total = hits + h, total + t
    if not out.mlps:
        raise TraceError(f"no {kind} predictor could be trained: no decode token in the trace's training part "
                         "reaches a later layer; trace more requests, with more generated tokens")
    out.accuracy = hits / total if total else 0.0
    return out
