"""Schedules as data: the decode (and prefill) passes as task graphs.

One graph feeds two consumers: `pipeline_executor.PipelineExecutor` launches it on a device
(CUDA streams + CPU threads, or the emulated accelerator) and `simulator.simulate`
times it with HRM costs. Both use the same semantics: every lane is serial; a lane
runs, among its launched tasks whose dependencies are done, the one launched first
(list scheduling with launch order as priority). A transfer that is not ready does not
block a ready one behind it; a long one that has started blocks everything after it,
which is why CGOPipe cuts a layer's weights into pages (paper section 4.1, Fig. 6).

Lanes: "gpu" (compute stream), "cpu" (attention worker thread), "h2d" and "d2h" (the
two link directions, independent of each other) and "pin" (the host thread that copies
CPU-resident weight pages into the pinned staging buffers; the first of the two hops).

Layer index `n_layers` in a decode graph means "layer 0 of the next step": the last
layer prefetches it so a steady-state step never waits for weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LANES = ("gpu", "cpu", "h2d", "d2h", "pin")
SCHEDULES = ("cgopipe", "flexgen", "flexgen-cpu", "overlap-unpaged")
# the optimizer's policy family of the one placement (A_g, F_g) each schedule runs: the FFN on the
# device with paged weights, attention on the CPU, or on the device for FlexGen's own loop
SCHEDULE_FAMILY = {"cgopipe": "cgopipe", "overlap-unpaged": "cgopipe", "flexgen-cpu": "cgopipe",
                   "flexgen": "flexgen"}


@dataclass
class Task:
    """One unit of work on one lane. `deps` are indices of tasks of the same graph."""

    index: int
    name: str
    lane: str
    op: str
    layer: int = -1
    mb: int = -1
    deps: tuple[int, ...] = ()
    nbytes: float = 0.0  # transfers / staging: bytes moved
    tokens: int = 0  # compute: tokens (decode: sequences) processed
    context: float = 0.0  # attention: mean context of the micro-batch
    page: int = -1  # weight pages: page index within the layer
    n_pages: int = 0
    slot: int = -1  # weight double-buffer slot / KV buffer slot / pinned staging slot
    pin_slot: int = -1


@dataclass(frozen=True)
class GraphShape:
    """What a graph needs to know about the model and the batch (sizes in bytes).

    The executor derives it from the real model and page table; the simulator from an
    HRM ModelSpec and a Policy. `mb_tokens[i]` is the number of sequences of micro-batch
    i (one token each in decode; prefill uses `prompt_tokens`).
    """

    n_layers: int
    mb_tokens: tuple[int, ...]
    mb_context: tuple[float, ...]
    qkv_bytes_per_token: float
    attn_bytes_per_token: float
    kv_bytes_per_token_layer: float
    logits_bytes_per_token: float
    paged_bytes_per_layer: float  # the CPU-resident expert bytes of one layer
    slot_base: int = 0  # double-buffer slot of layer 0
    first_layer_loaded: bool = True  # layer 0's pages already sit in slot `slot_base`
    prefetch_next: bool = True  # the last layer loads the next pass's layer 0
    prompt_tokens: int = 0  # prefill: packed prompt tokens of the pass

    @property
    def n_mb(self) -> int:
        return len(self.mb_tokens)


@dataclass
class Schedule:
    name: str
    shape: GraphShape
    tasks: list[Task] = field(default_factory=list)

    def add(self, name: str, lane: str, op: str, deps=(), **meta) -> int:
        assert lane in LANES, lane
        t = Task(len(self.tasks), name, lane, op, deps=tuple(d for d in deps if d is not None), **meta)
        assert all(0 <= d < t.index for d in t.deps), (name, t.deps)
        self.tasks.append(t)
        return t.index

    def by_lane(self, lane: str) -> list[Task]:
        return [t for t in self.tasks if t.lane == lane]

    def find(self, op: str, layer: int = -1, mb: int = -1) -> list[Task]:
        return [
            t for t in self.tasks if t.op == op and (layer < 0 or t.layer == layer) and (mb < 0 or t.mb == mb)
        ]


class _Builder:
    """Emits tasks with their data and buffer dependencies, so that schedules read as
    launch orders. Weight loading keeps the two hops and both buffer rings explicit:
    stage(g) -> pinned slot g%2 (waits for the h2d that last read that slot), then
    h2d(g) -> device slot of its layer (waits for the layer two back to finish)."""

    def __init__(self, name: str, shape: GraphShape) -> None:
        self.s = Schedule(name, shape)
        self.shape = shape
        self.weights: dict[int, list[int]] = {}  # layer -> h2d task ids of its pages
        self.posts: dict[int, list[int]] = {}  # layer -> post-attention task ids
        self.pages_issued = 0
        self.page_h2d: list[int] = []  # in issue order (pinned ring)
        self.x: dict[int, int] = {}  # micro-batch -> task that last wrote its hidden state
        self.kv_slots: list[int] = []  # FlexGen: GPU attention tasks in KV-buffer order
        self.last_kv_store: int | None = None  # FlexGen: the newest K/V copy back to the CPU cache

    @property
    def paged(self) -> bool:
        return self.shape.paged_bytes_per_layer > 0

    def slot(self, layer: int) -> int:
        return (self.shape.slot_base + layer) % 2

    # ---- weights ----
    def load_page(self, layer: int, page: int, n_pages: int, after: int | list[int] | None = None) -> None:
        """One page of `layer`'s CPU-resident experts: CPU memory -> pinned -> device
        (the link hop after task(s) `after`, if given)."""
        if not self.paged:
            return
        add, g = self.s.add, self.pages_issued
        nbytes = self.shape.paged_bytes_per_layer / n_pages
        pin_free = self.page_h2d[g - 2] if g >= 2 else None
        stage = add(
            f"stage L{layer} p{page}",
            "pin",
            "w_stage",
            [pin_free],
            layer=layer,
            page=page,
            n_pages=n_pages,
            nbytes=nbytes,
            pin_slot=g % 2,
        )
        slot_free = self.posts.get(layer - 2, [])  # the layer that used this device slot last
        h2d = add(
            f"W L{layer} p{page}",
            "h2d",
            "w_h2d",
            [stage, *(after if isinstance(after, list) else [after]), *slot_free],
            layer=layer,
            page=page,
            n_pages=n_pages,
            nbytes=nbytes,
            slot=self.slot(layer),
            pin_slot=g % 2,
        )
        self.pages_issued += 1
        self.page_h2d.append(h2d)
        self.weights.setdefault(layer, []).append(h2d)

    def load_layer(self, layer: int, n_pages: int, after: list[int] | None = None) -> None:
        for p in range(n_pages):
            self.load_page(layer, p, n_pages, after=after)

    # ---- compute and activations ----
    def embed(self, i: int) -> None:
        self.x[i] = self.s.add(f"embed m{i}", "gpu", "embed", mb=i, tokens=self.shape.mb_tokens[i])

    def pre(self, j: int, i: int, extra=()) -> int:
        t = self.s.add(
            f"pre L{j} m{i}",
            "gpu",
            "pre_attn",
            [self.x[i], *extra],
            layer=j,
            mb=i,
            tokens=self.shape.mb_tokens[i],
        )
        return t

    def cpu_attention(self, j: int, i: int, pre: int) -> int:
        """QKV GPU->CPU, attention next to the KV cache, attention output CPU->GPU."""
        sh, mu = self.shape, self.shape.mb_tokens[i]
        add = self.s.add
        d2h = add(
            f"QKV L{j} m{i}", "d2h", "qkv_d2h", [pre], layer=j, mb=i, nbytes=mu * sh.qkv_bytes_per_token
        )
        att = add(
            f"attn L{j} m{i}", "cpu", "cpu_attn", [d2h], layer=j, mb=i, tokens=mu, context=sh.mb_context[i]
        )
        return add(
            f"O L{j} m{i}", "h2d", "attn_h2d", [att], layer=j, mb=i, nbytes=mu * sh.attn_bytes_per_token
        )

    def post(self, j: int, i: int, attn: int, extra=(), tokens: int | None = None) -> int:
        t = self.s.add(
            f"post L{j} m{i}",
            "gpu",
            "post_attn",
            [self.x[i], attn, *self.weights.get(j, []), *extra],
            layer=j,
            mb=i,
            tokens=self.shape.mb_tokens[i] if tokens is None else tokens,
        )
        self.posts.setdefault(j, []).append(t)
        self.x[i] = t
        return t

    def logits(self, i: int) -> None:
        mu = self.shape.mb_tokens[i]
        head = self.s.add(f"head m{i}", "gpu", "lm_head", [self.x[i]], mb=i, tokens=mu)
        self.s.add(
            f"logits m{i}", "d2h", "logits_d2h", [head], mb=i, nbytes=mu * self.shape.logits_bytes_per_token
        )

    def gpu_attention(self, j: int, i: int, pre: int, after: list[int] | None = None) -> int:
        """FlexGen: this micro-batch's KV comes to the GPU (prefetched, once the tasks `after`
        are done), attention runs there, and the new token's K/V go back to the CPU cache."""
        sh, mu, add = self.shape, self.shape.mb_tokens[i], self.s.add
        c = len(self.kv_slots)
        slot_free = self.kv_slots[c - 2] if c >= 2 else None
        kv = add(
            f"KV L{j} m{i}",
            "h2d",
            "kv_h2d",
            [slot_free, *(after or [])],
            layer=j,
            mb=i,
            slot=c % 2,
            tokens=mu,
            nbytes=mu * sh.mb_context[i] * sh.kv_bytes_per_token_layer,
        )
        att = add(
            f"gattn L{j} m{i}",
            "gpu",
            "gpu_attn",
            [pre, kv],
            layer=j,
            mb=i,
            slot=c % 2,
            tokens=mu,
            context=sh.mb_context[i],
        )
        self.kv_slots.append(att)
        back = add(
            f"newKV L{j} m{i}", "d2h", "kv_d2h", [pre], layer=j, mb=i, nbytes=mu * sh.kv_bytes_per_token_layer
        )
        self.last_kv_store = back
        add(f"kvw L{j} m{i}", "cpu", "kv_write", [back], layer=j, mb=i, tokens=mu)
        return att

    def has_next(self, j: int) -> bool:
        """Whether layer j+1's weights are loaded during layer j (j+1 == L: next pass's layer 0)."""
        return j + 1 < self.shape.n_layers or self.shape.prefetch_next

    def prologue_weights(self, n_pages: int) -> None:
        if not self.shape.first_layer_loaded:
            self.load_layer(0, n_pages)


def build_cgopipe(shape: GraphShape) -> Schedule:
    """CGOPipe (paper Algorithm 1). For layer j and micro-batch i the launcher issues:
    GPU post-attention(j, i), then GPU pre-attention(j+1, i) of the same micro-batch;
    its QKV go to the CPU, the CPU computes attention(j+1, i) while the GPU proceeds with
    the next micro-batch, the result comes back; and page i of layer j+1's CPU-resident
    weights crosses the link between those small transfers."""
    b, L, n = _Builder("cgopipe", shape), shape.n_layers, shape.n_mb
    for i in range(n):
        b.embed(i)
    b.prologue_weights(n)
    attn = {i: b.cpu_attention(0, i, b.pre(0, i)) for i in range(n)}
    for j in range(L):
        for i in range(n):
            b.post(j, i, attn[i])
            if j + 1 < L:
                attn[i] = b.cpu_attention(j + 1, i, b.pre(j + 1, i))
            else:
                b.logits(i)
            if b.has_next(j):  # the page goes behind the attention output the GPU needs next
                b.load_page(j + 1, i, n, after=attn[i + 1] if i + 1 < n else None)
    return b.s


def build_overlap_unpaged(shape: GraphShape) -> Schedule:
    """Like CGOPipe (CPU attention overlapped with GPU work) but layer j+1's weights go
    as one block, issued when layer j starts: hidden-state transfers queue behind it."""
    b, L, n = _Builder("overlap-unpaged", shape), shape.n_layers, shape.n_mb
    for i in range(n):
        b.embed(i)
    b.prologue_weights(1)
    attn = {i: b.cpu_attention(0, i, b.pre(0, i)) for i in range(n)}
    for j in range(L):
        for i in range(n):
            b.post(j, i, attn[i])
            if i == 0 and b.has_next(j):
                b.load_layer(j + 1, 1)
            if j + 1 < L:
                attn[i] = b.cpu_attention(j + 1, i, b.pre(j + 1, i))
            else:
                b.logits(i)
    return b.s


def build_flexgen_cpu(shape: GraphShape) -> Schedule:
    """FlexGen with CPU attention, in FlexGen's own loop (see build_flexgen): per micro-batch
    pre -> QKV out -> CPU attention -> output in, and the next micro-batch's step waits for
    all of it (FlexGen's sync()); then the FFN step of every micro-batch."""
    return _flexgen(shape, "flexgen-cpu", cpu_attention=True)


def build_flexgen(shape: GraphShape) -> Schedule:
    """FlexGen, as its generation_loop_overlap_multi_batch runs: attention and the FFN are
    layers of their own in its loop, each stepped micro-batch by micro-batch. Step 0 of
    attention layer j issues the weights of FFN layer j (as one block); each micro-batch's KV
    cache comes to the GPU (prefetched into a double buffer) and its new K/V go back to the
    CPU cache. FlexGen calls sync() after every step, so a step starts only once the
    previous step's copies are done: the FFN weights overlap one attention step only."""
    return _flexgen(shape, "flexgen", cpu_attention=False)


def _flexgen(shape: GraphShape, name: str, cpu_attention: bool) -> Schedule:
    b, L, n = _Builder(name, shape), shape.n_layers, shape.n_mb
    for i in range(n):
        b.embed(i)
    pending: list[int] = []  # what FlexGen's sync() at the end of the last step waits for
    before: list[int] = []  # what the last step itself waited for: copies issued in it start then
    for j in range(L):
        attn = {}
        for i in range(n):  # FlexGen's attention layer j
            if i == 0 and (j > 0 or not shape.first_layer_loaded):  # issued at this step: the copy
                b.load_layer(j, 1, after=pending)  # starts once the last step is done
            pre = b.pre(j, i, extra=pending)
            if cpu_attention:
                attn[i] = b.cpu_attention(j, i, pre)
                step = [attn[i]]
            else:  # this micro-batch's KV was loaded in the previous step (FlexGen's load_cache(k+1))
                attn[i] = b.gpu_attention(j, i, pre, after=before)
                step = [attn[i], *([b.last_kv_store] if b.last_kv_store is not None else [])]
            if i == 0:
                step += b.weights.get(j, [])
            before, pending = pending, step
        for i in range(n):  # FlexGen's FFN layer j
            before, pending = pending, [b.post(j, i, attn[i], extra=pending)]
            if j + 1 == L:
                b.logits(i)
    if b.has_next(L - 1):  # the next pass's layer 0 (the runtime's protocol), in series as FlexGen
        b.load_layer(L, 1, after=pending)  # loads it in that pass's first step
    return b.s


def build_prefill(shape: GraphShape, name: str = "prefill") -> Schedule:
    """Prefill of one packed micro-batch, all on the GPU (paper section 4: compute bound,
    not pipelined further); each layer's K/V go to the CPU cache and layer j+1's
    weights stream in while layer j computes."""
    b, L = _Builder(name, shape), shape.n_layers
    T = shape.prompt_tokens
    b.x[0] = b.s.add("embed", "gpu", "embed", mb=0, tokens=T)
    b.prologue_weights(1)
    for j in range(L):
        if b.has_next(j):
            b.load_layer(j + 1, 1)
        pre = b.s.add(f"pre L{j}", "gpu", "pre_attn", [b.x[0]], layer=j, mb=0, tokens=T)
        back = b.s.add(
            f"KV L{j}", "d2h", "kv_d2h", [pre], layer=j, mb=0, nbytes=T * shape.kv_bytes_per_token_layer
        )
        b.s.add(f"kvw L{j}", "cpu", "kv_write", [back], layer=j, mb=0, tokens=T)
        att = b.s.add(
            f"pattn L{j}", "gpu", "prefill_attn", [pre], layer=j, mb=0, tokens=T, context=shape.mb_context[0]
        )
        b.post(j, 0, att, tokens=T if j + 1 < L else shape.mb_tokens[0])  # last layer: last tokens only
    b.logits(0)
    return b.s


BUILDERS = {
    "cgopipe": build_cgopipe,
    "flexgen": build_flexgen,
    "flexgen-cpu": build_flexgen_cpu,
    "overlap-unpaged": build_overlap_unpaged,
}


def build_decode(schedule: str, shape: GraphShape) -> Schedule:
    try:
        return BUILDERS[schedule](shape)
    except KeyError:
        raise ValueError(f"unknown schedule {schedule!r}; valid: {', '.join(SCHEDULES)}") from None


def attention_on_gpu(schedule: str) -> bool:
    return schedule == "flexgen"
