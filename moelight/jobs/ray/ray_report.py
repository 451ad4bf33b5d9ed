"""The closing report of a Ray job: the local run's figures for the whole job, and per replica.

Each replica reports every batch it ran (tokens, prefill / decode seconds, the plan it used); the
job's prefill and decode rates are the sum of the replicas' rates (they run side by side), and
end-to-end is the generated tokens over the wall time of the generation stage (replica start-up,
model loads included: on a cluster that is what a job costs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moelight.jobs.report import RunReport, _rate


@dataclass
class ReplicaFigures:
    replica: str
    batches: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_tokens: int = 0
    load_seconds: float = 0.0
    threads: int = 0
    attention_backend: str = ""
    peak_memory_bytes: int = 0
    batch_size: int = 0
    micro_batch_size: int = 0
    policy: dict = field(default_factory=dict)
    prediction: dict = field(default_factory=dict)

    def add(self, batch: dict) -> None:
        self.batches += 1
        for name in ("requests", "prompt_tokens", "generated_tokens", "decode_tokens"):
            setattr(self, name, getattr(self, name) + int(batch.get(name, 0)))
        self.prefill_seconds += batch.get("prefill_seconds", 0.0)
        self.decode_seconds += batch.get("decode_seconds", 0.0)
        self.load_seconds = batch.get("load_seconds", self.load_seconds)
        self.threads = batch.get("threads", self.threads)
        self.attention_backend = batch.get("attention_backend") or self.attention_backend
        self.peak_memory_bytes = max(self.peak_memory_bytes, batch.get("peak_memory_bytes", 0))
        if batch.get("batch_size"):
            self.batch_size, self.micro_batch_size = batch["batch_size"], batch["micro_batch_size"]
            self.policy = batch.get("policy", {})
            self.prediction = batch.get("prediction", {})

    def to_dict(self) -> dict:
        return {**self.__dict__, "prefill_tokens_per_s": _rate(self.prompt_tokens, self.prefill_seconds),
                "decode_tokens_per_s": _rate(self.decode_tokens, self.decode_seconds)}


@dataclass
class RayRunReport(RunReport):
    ray_address: str = ""
    wall_seconds: float = 0.0
    replicas: list = field(default_factory=list)  # ReplicaFigures.to_dict() per replica

    def fold(self, figures: dict[str, ReplicaFigures], stage_seconds: float) -> None:
        """Totals from the replicas' figures; the stage's wall time for end-to-end."""
        reps = list(figures.values())
        self.replicas = [r.to_dict() for r in reps]
        self.prompt_tokens = sum(r.prompt_tokens for r in reps)
        self.generated_tokens = sum(r.generated_tokens for r in reps)
        self.decode_tokens = sum(r.decode_tokens for r in reps)
        self.prefill_seconds = sum(r.prefill_seconds for r in reps)
        self.decode_seconds = sum(r.decode_seconds for r in reps)
        self.generation_seconds = stage_seconds
        self.load_seconds = max((r.load_seconds for r in reps), default=0.0)
        self.peak_memory_bytes = max((r.peak_memory_bytes for r in reps), default=0)
        self.prefill_tokens_per_s = sum(_rate(r.prompt_tokens, r.prefill_seconds) for r in reps)
        self.decode_tokens_per_s = sum(_rate(r.decode_tokens, r.decode_seconds) for r in reps)
        self.end_to_end_tokens_per_s = _rate(self.generated_tokens, stage_seconds)
        if reps:
            self.batch_size, self.micro_batch_size = reps[0].batch_size, reps[0].micro_batch_size
            self.policy = dict(reps[0].policy)
            self.attention_backend = reps[0].attention_backend
            self.prediction = dict(reps[0].prediction)

    def summary(self) -> str:
        lines = [super().summary().replace(" s loading)", " s loading, on the slowest replica)"),
                 f"ray           {len(self.replicas)} replica(s) at {self.ray_address}, "
                 f"{self.wall_seconds:.2f} s wall for the whole job"]
        for r in self.replicas:
            lines.append(f"  {r['replica']}: {r['requests']} requests in {r['batches']} batch(es) of <= "
                         f"{r['batch_size']}, {r['threads']} threads, prefill {r['prefill_tokens_per_s']:.1f} "
                         f"tok/s, decode {r['decode_tokens_per_s']:.1f} tok/s, load {r['load_seconds']:.2f} s")
        return "\n".join(lines)
