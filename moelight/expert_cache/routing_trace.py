"""Routing traces: which experts each token chose at each MoE layer, in one documented format.

`moelight trace` writes them, the EAM collection (eam.py), the cache simulator and the
predictors read them. A trace is a parquet file with one row per (request, token, layer):

| column | type | meaning |
|---|---|---|
| `request_id` | string | the request's id in the dataset |
| `request` | int32 | its index in the traced job (requests are kept in this order) |
| `position` | int32 | the token's position in the sequence: prompt tokens 0..P-1, then generated ones |
| `phase` | string | `prefill` (a prompt token) or `decode` (a generated token fed back) |
| `layer` | int16 | the MoE layer (the model's layer index; dense layers have no rows) |
| `experts` | list<int16> | the top-k experts the router chose, in the router's order; -1: not routed (the
  engine runs the last layer of a prefill only for each prompt's last token) |
| `weights` | list<float32> | their gate weights, in the same order |
| `hidden` | list<float32>, optional | the MoE block's input (what the router sees), with `--hidden` |

The schema's metadata holds `moelight.trace` (the format version) and `moelight.trace.model`
(JSON: model name, num_layers, num_experts, top_k, hidden_size, moe_layers). The last generated
token of a sequence is never fed back, so it has no rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moelight.errors import MoelightError

FORMAT_VERSION = "1"
_VERSION_KEY, _MODEL_KEY = b"moelight.trace", b"moelight.trace.model"
COLUMNS = ("request_id", "request", "position", "phase", "layer", "experts", "weights")


class TraceError(MoelightError):
    """A trace file moelight cannot use; the message names the file and what is wrong."""


@dataclass
class TraceModel:
    """The routing shape a trace was recorded with."""

    name: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    moe_layers: list[int]  # the layers with routed experts, ascending

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


@dataclass
class RequestTrace:
    """One request's routing: experts / weights [tokens, moe layers, k], hidden [tokens, layers, h]."""

    request_id: str
    prompt_len: int
    experts: np.ndarray
    weights: np.ndarray
    hidden: np.ndarray | None = None

    @property
    def tokens(self) -> int:
        return self.experts.shape[0]


@dataclass
class Trace:
    model: TraceModel
    requests: list[RequestTrace] = field(default_factory=list)

    def save(self, path: str | Path) -> Path:
        """Write the parquet file (rows in request, position, layer order)."""
        path = Path(path)
        cols: dict[str, list] = {c: [] for c in COLUMNS}
        hidden = any(r.hidden is not None for r in self.requests)
        if hidden:
            cols["hidden"] = []
        for i, r in enumerate(self.requests):
            for t in range(r.tokens):
                for j, layer in enumerate(self.model.moe_layers):
                    cols["request_id"].append(r.request_id)
                    cols["request"].append(i)
                    cols["position"].append(t)
                    cols["phase"].append("prefill" if t < r.prompt_len else "decode")
                    cols["layer"].append(layer)
                    cols["experts"].append(r.experts[t, j].tolist())
                    cols["weights"].append(r.weights[t, j].tolist())
                    if hidden:
                        cols["hidden"].append(r.hidden[t, j].tolist())
        types = {"request_id": pa.string(), "request": pa.int32(), "position": pa.int32(), "phase": pa.string(),
                 "layer": pa.int16(), "experts": pa.list_(pa.int16()), "weights": pa.list_(pa.float32()),
                 "hidden": pa.list_(pa.float32())}
        table = pa.table({c: pa.array(v, type=types[c]) for c, v in cols.items()})
        table = table.replace_schema_metadata({_VERSION_KEY: FORMAT_VERSION.encode(),
                                               _MODEL_KEY: self.model.to_json().encode()})
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)
        return path

    @classmethod
    def load(cls, path: str | Path, hidden: bool = False) -> Trace:
        """Read and check a trace; TraceError says what is wrong and where."""
        path = Path(path)
        if not path.is_file():
            raise TraceError(f"{path}: no such trace file; write one with `moelight trace`")
        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow's own error types for a file that is not parquet
            raise TraceError(f"{path}: not a parquet file ({e})") from None
        meta = table.schema.metadata or {}
        if meta.get(_VERSION_KEY) != FORMAT_VERSION.encode():
            raise TraceError(f"{path}: not a moelight routing trace (format {FORMAT_VERSION} metadata missing); "
                             "write one with `moelight trace`")
        missing = [c for c in COLUMNS if c not in table.column_names]
        if missing:
            raise TraceError(f"{path}: trace lacks column(s) {', '.join(missing)}")
        if hidden and "hidden" not in table.column_names:
            raise TraceError(f"{path}: this trace has no hidden states; record one with `moelight trace --hidden`")
        try:
            model = TraceModel(**json.loads(meta[_MODEL_KEY]))
        except (KeyError, TypeError, ValueError) as e:
            raise TraceError(f"{path}: unreadable model metadata ({e})") from None
        return cls(model, _requests(path, table, model, hidden))


def _requests(path: Path, table: pa.Table, m: TraceModel, hidden: bool) -> list[RequestTrace]:
    req = table.column("request").to_numpy()
    pos = table.column("position").to_numpy()
    layer = table.column("layer").to_numpy()
    experts = table.column("experts").to_pylist()
    weights = table.column("weights").to_pylist()
    if any(len(e) != m.top_k for e in experts) or any(len(w) != m.top_k for w in weights):
        raise TraceError(f"{path}: every row needs top_k={m.top_k} experts and weights")
    ex, w = np.asarray(experts, dtype=np.int64), np.asarray(weights, np.float32)
    if ex.size and (ex.min() < -1 or ex.max() >= m.num_experts):
        bad_id = int(ex.max()) if ex.max() >= m.num_experts else int(ex.min())
        raise TraceError(f"{path}: expert id {bad_id} outside 0..{m.num_experts - 1} (-1: not routed)")
    slot = {layer_: j for j, layer_ in enumerate(m.moe_layers)}
    bad = sorted(set(layer.tolist()) - set(slot))
    if bad:
        raise TraceError(f"{path}: layer(s) {bad} are not MoE layers of the traced model ({m.moe_layers})")
    hid = np.asarray(table.column("hidden").to_pylist(), np.float32) if hidden else None
    ids = table.column("request_id").to_pylist()
    phase = table.column("phase").to_pylist()
    out = []
    for r in np.unique(req):
        rows = np.flatnonzero(req == r)
        n_tok, n_lay = int(pos[rows].max()) + 1, len(m.moe_layers)
        if len(rows) != n_tok * n_lay:
            raise TraceError(f"{path}: request {ids[rows[0]]} has {len(rows)} rows, expected "
                             f"{n_tok} tokens x {n_lay} MoE layers")
        order = rows[np.lexsort((np.array([slot[x] for x in layer[rows]]), pos[rows]))]
        shape = (n_tok, n_lay, m.top_k)
        out.append(RequestTrace(
            ids[rows[0]], sum(1 for i in rows if phase[i] == "prefill") // n_lay,
            ex[order].reshape(shape), w[order].reshape(shape),
            hid[order].reshape(n_tok, n_lay, -1) if hid is not None else None))
    return out
