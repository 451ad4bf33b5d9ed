"""The closing report of a job: throughput as DESIGN.md §9 defines it, memory, the policy.

One report type for every job: a local run, each model of a CoE job and each replica of a Ray job
fold their parts with `absorb`, generation rounds with `add_stats`; `close` takes what the session
knows at the end (the executor's figures, peak memory).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from cpu_kernels import kernel_backend
from moelight.engine.generation import GenerationStats
from moelight.jobs.atomic_write import write_text_atomic
from moelight.jobs.job_warnings import JobWarnings
from moelight.planning.memory_check import peak_rss_bytes

# the runtime's own figures in an executor's stats (the rest, where present, are the expert cache's)
_RUNTIME = ("device", "schedule", "pageable_copies", "gpu_lane_syncs_per_step", "launches_per_layer_pass",
            "counted_decode_steps", "device_memory_peak")
_SUMMED = ("prompt_tokens", "generated_tokens", "decode_tokens", "prefill_seconds", "decode_seconds",
           "generation_seconds", "load_seconds", "skipped_requests", "written", "prefill_computed_tokens",
           "prefix_reused_tokens")


@dataclass
class RunReport:
    model: str
    dtype: str
    requests: int
    batch_size: int
    micro_batch_size: int
    prompt_tokens: int = 0  # each finished request's prompt once: its n samples share it (vLLM's count)
    generated_tokens: int = 0
    decode_tokens: int = 0
    prefill_computed_tokens: int = 0  # prompt positions prefill ran (shared prefixes run once)
    prefix_reused_tokens: int = 0  # prompt positions whose KV came from a shared prefix
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    generation_seconds: float = 0.0
    load_seconds: float = 0.0
    prefill_tokens_per_s: float = 0.0  # prefill_computed_tokens per prefill second: reused prefixes cost nothing
    decode_tokens_per_s: float = 0.0
    end_to_end_tokens_per_s: float = 0.0
    peak_memory_bytes: int = 0
    attention_backend: str = ""
    skipped_requests: int = 0
    skipped: list = field(default_factory=list)  # every skipped record and request, "file:line: why"
    interrupted: bool = False
    policy: dict = field(default_factory=dict)
    prediction: dict = field(default_factory=dict)
    tpot_ms: dict = field(default_factory=dict)  # time per output token: p50 / p90 / p99 of the decode steps
    cache: dict = field(default_factory=dict)  # latency mode: the expert cache's hits, prefetches, bytes moved
    output: str = ""  # the file the job writes ("" for the Python API, which returns its results)
    written: int = 0  # results this run wrote to the output
    already_in_output: int = 0  # results a resumed output held before this run
    warnings: dict = field(default_factory=dict)  # JobWarnings.to_dict(): what was changed to make requests run
    notes: list = field(default_factory=list)  # what the user should know (e.g. an output without a job record)
    previous_runs: list = field(default_factory=list)  # a resumed output's earlier reports, oldest first
    # cuda / emulated: host syncs the compute lane issued per decode step, kernel launches per layer pass
    gpu_lane_syncs_per_step: float | None = None
    launches_per_layer_pass: float | None = None
    runtime: dict = field(default_factory=dict)  # the device, schedule and copies behind those figures
    error: str | None = None  # the error the job stopped on (its first line), None when it ended normally

    @classmethod
    def for_plan(cls, model: str, dtype: str, plan, requests: int, skipped: list[str] = ()) -> RunReport:
        """The report of a planned job (plan None: nothing left to generate); `skipped`: what was left out."""
        skips = dict(skipped_requests=len(skipped), skipped=list(skipped))
        if plan is None:
            return cls(model=model, dtype=dtype, requests=requests, batch_size=0, micro_batch_size=0, **skips)
        return cls(model=model, dtype=dtype, requests=requests, batch_size=plan.batch_size,
                   micro_batch_size=plan.micro_batch_size, policy=dict(plan.info),
                   prediction=dict(plan.prediction), attention_backend=kernel_backend(),
                   notes=[plan.info["warning"]] if plan.info.get("warning") else [], **skips)

    def add_stats(self, s: GenerationStats, prompt_tokens: int | None = None) -> None:
        """Fold in one generation round (multi-turn jobs have several); `prompt_tokens`: its finished
        requests' prompts, each once (the engine's `s.prompt_tokens` counts every sample's)."""
        steps = self.__dict__.setdefault("_steps", [])
        steps.extend(s.step_seconds)
        if steps:
            ordered = sorted(steps)
            self.tpot_ms = {f"p{q}": 1e3 * ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]
                            for q in (50, 90, 99)}
        self.prompt_tokens += s.prompt_tokens if prompt_tokens is None else prompt_tokens
        self.generated_tokens += s.generated_tokens
        self.prefill_seconds += s.prefill_seconds
        self.decode_seconds += s.decode_seconds
        self.generation_seconds += s.wall_seconds
        self.decode_tokens += s.decode_tokens
        self.prefill_computed_tokens += s.prefill_computed_tokens
        self.prefix_reused_tokens += s.prefix_reused_tokens
        self.update_rates()

    def absorb(self, part: RunReport) -> None:
        """Add another part of the same job (a CoE model's run, a Ray batch): counts and seconds add,
        peak memory is the larger, warnings add up, rates are recomputed from the sums."""
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(part, name))
        self.skipped = self.skipped + part.skipped
        if part.warnings:
            merged = JobWarnings(**self.warnings) if self.warnings else JobWarnings()
            merged.absorb(part.warnings)
            self.warnings = merged.to_dict()
        self.interrupted = self.interrupted or part.interrupted
        self.peak_memory_bytes = max(self.peak_memory_bytes, part.peak_memory_bytes)
        for name in ("dtype", "attention_backend"):  # what the parts ran with, each named once
            setattr(self, name, _joined(getattr(self, name), getattr(part, name)))
        for name in ("gpu_lane_syncs_per_step", "launches_per_layer_pass"):  # the worst part's
            if getattr(part, name) is not None:
                setattr(self, name, max(getattr(self, name) or 0.0, getattr(part, name)))
        self.update_rates()

    def update_rates(self, wall_seconds: float | None = None) -> None:
        """Rates from the sums; end-to-end over `wall_seconds` when given (a job's whole wall time),
        else over the generation time."""
        self.prefill_tokens_per_s = rate(self.prefill_computed_tokens, self.prefill_seconds)
        self.decode_tokens_per_s = rate(self.decode_tokens, self.decode_seconds)
        self.end_to_end_tokens_per_s = rate(self.generated_tokens, self.generation_seconds
                                            if wall_seconds is None else wall_seconds)

    def close(self, session) -> None:
        """What the session knows once the job has ended: the executor's figures and peak memory."""
        stats = dict(session.executor_stats())
        self.runtime = {k: stats.pop(k) for k in _RUNTIME if k in stats}
        self.gpu_lane_syncs_per_step = self.runtime.pop("gpu_lane_syncs_per_step", None)
        self.launches_per_layer_pass = self.runtime.pop("launches_per_layer_pass", None)
        self.cache = stats if "slots" in stats else {}
        self.peak_memory_bytes = max(self.peak_memory_bytes, peak_rss_bytes())

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: Path) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")

    def previous(self) -> dict:
        """What a later, resumed run keeps of this one."""
        keep = ("requests", "written", "generated_tokens", "generation_seconds", "end_to_end_tokens_per_s",
                "interrupted", "model", "dtype")
        return {k: getattr(self, k) for k in keep}

    def _model_line(self) -> str:
        coe = self.policy.get("coe")
        if coe:  # a CoE job: each model ran with its own plan (printed as it started)
            models = ", ".join(f"{m} ({f['requests']} requests)" for m, f in coe["models"].items())
            return (f"model         {self.model} ({self.dtype}), a CoE of {models}; {coe['order']} order, "
                    f"{coe['switches']} model load(s)")
        tp, batching = self.policy.get("tensor_parallel", 1), self.policy.get("batching")
        return (f"model         {self.model} ({self.dtype}), batch {self.batch_size}, micro-batch "
                f"{self.micro_batch_size}" + (f", {batching} batching" if batching else "")
                + (f", tensor parallel over {tp} ranks" if tp > 1 else ""))

    def written_line(self) -> str:
        total = self.already_in_output + self.written
        held = f" (+{self.already_in_output} already in the output = {total})" if self.already_in_output else ""
        return f"written       {self.written} of {self.requests} results{held}"

    def summary(self) -> str:
        gib = 2**30
        lines = [
            f"requests      {self.requests} ({self.skipped_requests} skipped)"
            + ("  [interrupted]" if self.interrupted else ""),
            *([self.written_line()] if self.output else []),
            self._model_line(),
            f"tokens        {self.prompt_tokens} prompt, {self.generated_tokens} generated"
            + (f" (prefill computed {self.prefill_computed_tokens} prompt positions and took "
               f"{self.prefix_reused_tokens} from shared prefixes)" if self.prefix_reused_tokens else ""),
            f"prefill       {self.prefill_tokens_per_s:10.1f} tok/s  ({self.prefill_seconds:.2f} s; "
            "positions computed)",
            f"decode        {self.decode_tokens_per_s:10.1f} tok/s  ({self.decode_seconds:.2f} s)",
            f"end-to-end    {self.end_to_end_tokens_per_s:10.1f} tok/s  ({self.generation_seconds:.2f} s generating,"
            f" {self.load_seconds:.2f} s loading)",
            f"peak memory   {self.peak_memory_bytes / gib:.2f} GiB  (attention: {self.attention_backend})",
        ]
        if self.tpot_ms:
            t = self.tpot_ms
            lines.append(f"per token     p50 {t['p50']:.1f} ms, p90 {t['p90']:.1f} ms, p99 {t['p99']:.1f} ms "
                         "(time per decode step)")
        if self.gpu_lane_syncs_per_step is not None:
            lines.append(f"runtime       {self.runtime.get('device', '')}: {self.gpu_lane_syncs_per_step:.1f} host "
                         f"syncs per decode step from the compute lane, {self.launches_per_layer_pass:.0f} kernel "
                         "launches per layer pass")
        if self.cache:
            c = self.cache
            lines.append(f"expert cache  {c['slots']} slots, {c['policy']}: hit rate {c['hit_rate']:.1%}, prefetch "
                         f"recall {c['prefetch_recall']:.1%} ({c['prefetch_used']} used / {c['prefetch_issued']} "
                         f"issued, {c['prefetch_late']} late, {c['prefetch_wasted']} wasted, "
                         f"{c['prefetch_issued'] - c['prefetch_used'] - c['prefetch_wasted']} unused at the end), "
                         f"{c['fetched_bytes'] / 2**20:.1f} MiB moved" + _offcache(c))
        if self.prediction:
            p = self.prediction
            lines.append(f"predicted     {p.get('end_to_end_tokens_per_s', 0):10.1f} tok/s end-to-end (HRM"
                         f"{profile_age_text(self.policy.get('hardware_measured_at', ''))})")
        lines += [f"warning       {line}" for line in JobWarnings(**self.warnings).lines()] if self.warnings else []
        lines += self._skipped_lines()
        lines += [f"note          {note}" for note in self.notes]
        if self.previous_runs:
            lines.append(f"earlier runs  {len(self.previous_runs)} on this output wrote "
                         f"{sum(r.get('written', 0) for r in self.previous_runs)} results")
        return "\n".join(lines)

    def _skipped_lines(self, shown: int = 5) -> list[str]:
        """The first skipped records by file:line; the report holds them all."""
        lines = [f"skipped       {s}" for s in self.skipped[:shown]]
        if len(self.skipped) > shown:
            lines.append(f"skipped       ... and {len(self.skipped) - shown} more (the report's \"skipped\" lists all)")
        return lines


def _offcache(cache: dict) -> str:
    """Misses served without a fetch into the cache (CoServe / combined run them on the CPU, DuoServe's
    prefill streams them): without them a 0% hit rate and nothing moved reads as nothing happening."""
    cpu, streamed = cache.get("cpu_executed", 0), cache.get("streamed", 0)
    return ((f", {cpu} of {cache['misses']} misses run on the CPU" if cpu else "")
            + (f", {streamed} experts streamed through prefill's own slots" if streamed else ""))


def _joined(mine: str, theirs: str) -> str:
    """'a / b': the distinct values parts of a job ran with ('auto' and '' are no value)."""
    names = [n for n in (*mine.split(" / "), *theirs.split(" / ")) if n and n != "auto"]
    return " / ".join(dict.fromkeys(names)) or mine


def rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def profile_age_text(measured_at: str, now: datetime | None = None) -> str:
    """", from a profile measured 3.2 h ago": a prediction misses by as much as the host's speed drifted
    since its profile (on a shared 2-core guest, ~1.3x within an hour), so the reader can weigh it; "" for a
    preset or a profile without its time."""
    try:
        when = datetime.fromisoformat(measured_at)
    except (TypeError, ValueError):
        return ""
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    age = ((now or datetime.now(timezone.utc)) - when).total_seconds()
    for unit, seconds in (("d", 86400), ("h", 3600), ("min", 60)):
        if age >= seconds:
            return f", from a profile measured {age / seconds:.1f} {unit} ago"
    return ", from a profile measured just before the job"

