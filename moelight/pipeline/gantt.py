"""Gantt chart of a timeline (simulated, or measured from a real pass's events).

matplotlib is imported lazily with the Agg backend, so nothing else needs it.
"""

from __future__ import annotations

from pathlib import Path

from moelight.pipeline.schedule import LANES
from moelight.pipeline.schedule_simulator import Timeline

COLORS = {
    "pre_attn": "#4c72b0",
    "post_attn": "#55a868",
    "cpu_attn": "#c44e52",
    "gpu_attn": "#c44e52",
    "qkv_d2h": "#8172b2",
    "attn_h2d": "#8172b2",
    "kv_d2h": "#937860",
    "kv_h2d": "#da8bc3",
    "w_h2d": "#ccb974",
    "w_stage": "#ccb974",
    "lm_head": "#64b5cd",
    "logits_d2h": "#64b5cd",
    "prefill_attn": "#c44e52",
    "embed": "#8c8c8c",
    "kv_write": "#937860",
}


def timeline_from_events(schedule, events) -> Timeline:
    """A measured Timeline from the device events of an executed pass (seconds from its start)."""
    t0 = min(e.t_start for e in events)
    return Timeline(schedule, [e.t_start - t0 for e in events], [e.t_end - t0 for e in events])


def draw_gantt(timelines: list[tuple[str, Timeline]], path: str | Path, until: float | None = None) -> Path:
    """One panel per timeline, one row per lane, one bar per task, coloured by operator."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(14, 1.9 * len(timelines) + 0.6), squeeze=False)
    span = until or max(tl.makespan for _, tl in timelines)
    for ax, (title, tl) in zip(axes[:, 0], timelines, strict=True):
        lanes = [lane for lane in LANES if tl.schedule.by_lane(lane)]
        for row, lane in enumerate(lanes):
            for t in tl.schedule.by_lane(lane):
                s, e = tl.start[t.index], tl.end[t.index]
                if s > span:
                    continue
                ax.broken_barh(
                    [(s * 1e3, max(e - s, 1e-9) * 1e3)],
                    (row - 0.4, 0.8),
                    facecolors=COLORS.get(t.op, "#999999"),
                    edgecolor="white",
                    linewidth=0.2,
                )
        ax.set_yticks(range(len(lanes)), lanes)
        ax.set_xlim(0, span * 1e3)
        ax.invert_yaxis()
        ax.set_title(f"{title}  (pass {tl.makespan * 1e3:.1f} ms)", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("time (ms)")
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=c)
        for c in ("#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974", "#da8bc3", "#64b5cd")
    ]
    fig.legend(
        handles,
        [
            "pre-attention",
            "post-attention (MoE)",
            "attention",
            "QKV / attn out",
            "weight pages",
            "KV prefetch",
            "LM head",
        ],
        loc="upper right",
        ncol=7,
        fontsize=7,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p
