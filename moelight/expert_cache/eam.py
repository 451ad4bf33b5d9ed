"""MoE-Infinity's Expert Activation Matrices (paper 004, section 4): what one sequence routed where.

An EAM is an [L, E] matrix of token counts: row l counts the tokens the sequence sent to each
expert of MoE layer l. The distance of two EAMs is Eq. (1): one minus the mean over layers of the
cosine similarity of their rows (each row normalised to its share, so sequences of any length
compare). An EAM collection (EAMC) keeps P representative EAMs of a dataset: K-means with that
distance (spherical K-means on unit rows, since then the mean over layers of row cosines is a dot
product), and for each cluster the member EAM nearest its centroid, as the paper stores.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moelight.errors import MoelightError


class EAMError(MoelightError):
    """An EAM collection that cannot be used; the message names the file and the problem."""


def eam_of(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """Counts [L, E] from a sequence's routed experts [tokens, L, k] (-1: not routed, not counted)."""
    tokens, layers, k = experts.shape
    out = np.zeros((layers, num_experts), np.float64)
    for j in range(layers):
        e = experts[:, j].reshape(-1)
        out[j] = np.bincount(e[e >= 0], minlength=num_experts)[:num_experts]
    return out


def unit_rows(m: np.ndarray) -> np.ndarray:
    """Each layer's row scaled to unit length (a zero row stays zero); works on [.., L, E]."""
    norm = np.linalg.norm(m, axis=-1, keepdims=True)
    return np.divide(m, norm, out=np.zeros_like(m, dtype=np.float64), where=norm > 0)


def eam_distances(cur: np.ndarray, eams: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """Eq. (1) between `cur` [L, E] and each of `eams` [P, L, E], averaged over `rows` (the layers
    `cur` has seen; all by default)."""
    rows = np.arange(cur.shape[0]) if rows is None else np.asarray(rows)
    if rows.size == 0:
        return np.ones(len(eams))
    sims = (unit_rows(eams[:, rows]) * unit_rows(cur[rows])[None]).sum(-1)  # [P, rows]
    return 1.0 - sims.mean(-1)


@dataclass
class EAMCollection:
    """P representative EAMs [P, L, E] of a model whose routing has L MoE layers and E experts."""

    eams: np.ndarray
    model: str = ""

    @property
    def shape(self) -> tuple[int, int]:
        return self.eams.shape[1], self.eams.shape[2]

    def nearest(self, cur: np.ndarray) -> np.ndarray:
        """The stored EAM nearest `cur` over the layers it has seen (rows with any token)."""
        seen = np.flatnonzero(cur.sum(-1) > 0)
        return self.eams[int(np.argmin(eam_distances(cur, self.eams, seen)))]

    @classmethod
    def build(cls, eams: np.ndarray, capacity: int, seed: int = 0, iterations: int = 30,
              model: str = "") -> EAMCollection:
        """K-means (k = capacity) with Eq. (1)'s distance; each cluster keeps its member nearest the
        centroid. With no more EAMs than the capacity, all are kept."""
        eams = np.asarray(eams, np.float64)
        if capacity < 1:
            raise EAMError(f"EAM collection capacity must be >= 1, not {capacity}")
        if len(eams) <= capacity:
            return cls(eams.copy(), model)
        flat = unit_rows(eams).reshape(len(eams), -1)
        layers = eams.shape[1]
        centers = flat[_plus_plus(flat, capacity, np.random.default_rng(seed), layers)]
        for _ in range(iterations):
            assign = np.argmax(flat @ centers.T, axis=1)  # max mean cosine = min Eq. (1)
            new = centers.copy()
            for c in range(capacity):
                members = flat[assign == c]
                if len(members):
                    new[c] = unit_rows(members.mean(0).reshape(layers, -1)).reshape(-1)
            if np.allclose(new, centers):
                break
            centers = new
        assign = np.argmax(flat @ centers.T, axis=1)
        keep = []
        for c in range(capacity):
            members = np.flatnonzero(assign == c)
            if len(members):
                keep.append(int(members[np.argmax(flat[members] @ centers[c])]))
        return cls(eams[sorted(set(keep))].copy(), model)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as f:
            np.savez(f, eams=self.eams, meta=np.array(json.dumps({"format": "moelight-eamc-1", "model": self.model})))
        return path

    @classmethod
    def load(cls, path: str | Path, layers: int | None = None, experts: int | None = None) -> EAMCollection:
        """Read a collection; with `layers` / `experts`, check it fits the model it will serve."""
        path = Path(path)
        if not path.is_file():
            raise EAMError(f"{path}: no such EAM collection; build one with `moelight eamc --trace TRACE`")
        try:
            with np.load(path, allow_pickle=False) as z:
                eams, meta = z["eams"], json.loads(str(z["meta"]))
        except Exception:  # zipfile / numpy / json errors of a file that is not ours (numpy's own advice,
            # to load it with allow_pickle, would be wrong here)
            raise EAMError(f"{path}: not an EAM collection (the .npz `moelight eamc` writes); build one with "
                           "`moelight eamc --trace TRACE --output FILE.npz`") from None
        if meta.get("format") != "moelight-eamc-1" or eams.ndim != 3:
            raise EAMError(f"{path}: not an EAM collection written by `moelight eamc`")
        got = eams.shape[1:]
        if (layers is not None and got[0] != layers) or (experts is not None and got[1] != experts):
            raise EAMError(f"{path}: EAMs of {got[0]} MoE layers x {got[1]} experts (model {meta.get('model')!r}), "
                           f"but this model routes {layers} x {experts}; build the collection from its own trace")
        return cls(eams, meta.get("model", ""))


def _plus_plus(flat: np.ndarray, k: int, rng: np.random.Generator, layers: int) -> list[int]:
    """K-means++ seeds under Eq. (1) (a dot of concatenated unit rows / L is the mean cosine)."""
    chosen = [int(rng.integers(len(flat)))]
    dist = np.maximum(0.0, 1.0 - flat @ flat[chosen[0]] / layers)
    while len(chosen) < k:
        p = dist / dist.sum() if dist.sum() > 0 else np.full(len(flat), 1 / len(flat))
        nxt = int(rng.choice(len(flat), p=p))
        chosen.append(nxt)
        dist = np.minimum(dist, np.maximum(0.0, 1.0 - flat @ flat[nxt] / layers))
    return chosen
