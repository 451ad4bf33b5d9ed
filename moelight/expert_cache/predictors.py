"""What the learned and profiled policies know before a job: a routing profile and small MLPs.

- `RoutingProfile`: per MoE layer, each expert's share of the routing (popularity) and, between
  consecutive layers, P(expert j next | expert i here) (affinity); DuoServe's and CoServe's
  offline statistics, from a trace.
- `MLP`: a numpy forward pass (ReLU between layers, logits out), so the policies that use one
  stay torch-free and run the same in the runtime and the simulator.
- `Predictors`: the file `moelight train-predictor` writes (.npz): the kind (`promoe`: layer l's
  MoE input -> the experts of layer l + stride; `duoserve`: the token's expert path so far, the
  next layer's popularity and the affinity row of its experts -> the next layer's experts;
  `coserve`: the profile only), the profile, one MLP per predicting layer, and the accuracy
  measured on the held-out tenth of the trace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moelight.errors import MoelightError
from moelight.expert_cache.routing_trace import Trace

KINDS = ("promoe", "duoserve", "coserve")


class PredictorError(MoelightError):
    """A predictor file that cannot serve this model or policy; the message names the file."""


@dataclass
class RoutingProfile:
    popularity: np.ndarray  # [L, E]: each layer's routing shares
    affinity: np.ndarray  # [L-1, E, E]: row i -> P(expert j at layer l+1 | expert i at layer l)

    @classmethod
    def from_trace(cls, trace: Trace) -> RoutingProfile:
        L, E = len(trace.model.moe_layers), trace.model.num_experts
        pop = np.zeros((L, E))
        aff = np.zeros((max(0, L - 1), E, E))
        for r in trace.requests:
            ex = r.experts
            for j in range(L):
                e = ex[:, j].reshape(-1)
                pop[j] += np.bincount(e[e >= 0], minlength=E)
            for j in range(L - 1):
                for t in range(ex.shape[0]):
                    here, nxt = ex[t, j][ex[t, j] >= 0], ex[t, j + 1][ex[t, j + 1] >= 0]
                    for i in here:
                        aff[j, i, nxt] += 1
        pop /= np.maximum(pop.sum(1, keepdims=True), 1e-12)
        aff /= np.maximum(aff.sum(2, keepdims=True), 1e-12)
        return cls(pop, aff)


class MLP:
    """Dense layers [(W [in, out], b [out]), ...], ReLU between them; returns logits."""

    def __init__(self, layers: list[tuple[np.ndarray, np.ndarray]]) -> None:
        self.layers = layers

    def __call__(self, x: np.ndarray) -> np.ndarray:
        for k, (w, b) in enumerate(self.layers):
            x = x @ w + b
            if k + 1 < len(self.layers):
                x = np.maximum(x, 0.0)
        return x


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(x, -30, 30)))


def duoserve_features(path: np.ndarray, layer: int, here: np.ndarray, profile: RoutingProfile) -> np.ndarray:
    """DuoServe's state for predicting layer+1: the token's expert path so far (multi-hot [L*E],
    zero beyond `layer`), the next layer's popularity [E] and the affinity of this layer's
    experts `here` (counts [E]) towards the next [E]."""
    mix = here @ profile.affinity[layer] / max(1.0, here.sum())
    return np.concatenate([path.reshape(-1), profile.popularity[layer + 1], mix])


@dataclass
class Predictors:
    kind: str
    layers: int
    experts: int
    top_k: int
    hidden_size: int
    profile: RoutingProfile
    stride: int = 1
    mlps: dict[int, MLP] = field(default_factory=dict)  # predicting layer -> its MLP
    accuracy: float = 0.0  # held-out: share of the target layer's experts in the predicted top-k
    model: str = ""

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {"popularity": self.profile.popularity, "affinity": self.profile.affinity}
        for j, mlp in self.mlps.items():
            for k, (w, b) in enumerate(mlp.layers):
                arrays[f"mlp{j}_w{k}"], arrays[f"mlp{j}_b{k}"] = w, b
        meta = {"format": "moelight-predictors-1", "kind": self.kind, "layers": self.layers, "experts": self.experts,
                "top_k": self.top_k, "hidden_size": self.hidden_size, "stride": self.stride,
                "accuracy": self.accuracy, "model": self.model,
                "mlps": {str(j): len(m.layers) for j, m in self.mlps.items()}}
        with path.open("wb") as f:
            np.savez(f, meta=np.array(json.dumps(meta)), **arrays)
        return path

    @staticmethod
    def _read(path: Path, arrays: bool = True) -> tuple[dict, dict]:
        """(meta, arrays) of a file checked to be a predictor file (arrays only if asked for)."""
        if not path.is_file():
            raise PredictorError(f"{path}: no such predictor file; train one with `moelight train-predictor`")
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                data = {k: z[k] for k in z.files if k != "meta"} if arrays else {}
        except Exception:  # zip / numpy / json errors of a file that is not ours (numpy's advice does not apply)
            raise PredictorError(f"{path}: not a predictor file (the .npz `moelight train-predictor` writes); train "
                                 "one with `moelight train-predictor --trace TRACE --kind KIND --output FILE.npz`"
                                 ) from None
        if not isinstance(meta, dict) or meta.get("format") != "moelight-predictors-1":
            raise PredictorError(f"{path}: not a predictor file written by `moelight train-predictor`")
        return meta, data

    @classmethod
    def check_kind(cls, path: str | Path, kind: str) -> None:
        """PredictorError unless `path` is a predictor file for the `kind` policy (read before any model loads)."""
        meta, _ = cls._read(Path(path), arrays=False)
        if meta["kind"] != kind:
            raise PredictorError(f"{path}: a {meta['kind']} predictor; the {kind} policy needs "
                                 f"`moelight train-predictor --kind {kind}`")

    @classmethod
    def load(cls, path: str | Path, kind: str, layers: int, experts: int, hidden_size: int | None = None
             ) -> Predictors:
        """Read a predictor file and check it serves this policy and model."""
        path = Path(path)
        cls.check_kind(path, kind)
        meta, arrays = cls._read(path)
        if (meta["layers"], meta["experts"]) != (layers, experts) or (
                hidden_size is not None and kind == "promoe" and meta["hidden_size"] != hidden_size):
            raise PredictorError(f"{path}: trained for {meta['layers']} MoE layers x {meta['experts']} experts "
                                 f"(hidden {meta['hidden_size']}, model {meta.get('model')!r}); this model routes "
                                 f"{layers} x {experts} (hidden {hidden_size}): train it on this model's trace")
        mlps = {int(j): MLP([(arrays[f"mlp{j}_w{k}"], arrays[f"mlp{j}_b{k}"]) for k in range(n)])
                for j, n in meta["mlps"].items()}
        return cls(meta["kind"], layers, experts, meta["top_k"], meta["hidden_size"],
                   RoutingProfile(arrays["popularity"], arrays["affinity"]), meta["stride"], mlps, meta["accuracy"],
                   meta.get("model", ""))
