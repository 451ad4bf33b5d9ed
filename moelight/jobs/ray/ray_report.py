"""The closing report of a Ray job: the local run's figures for the whole job, and per replica.

Each replica's batches fold into a RunReport of its own (`absorb`, as a CoE job folds its models);
the job's prefill and decode rates are the sum of the replicas' rates (they run side by side), and
end-to-end is the generated tokens over the wall time of the generation stage (replica start-up,
model loads included: on a cluster that is what a job costs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moelight.jobs.report import RunReport


@dataclass
class ReplicaFigures:
    replica: str
    batches: int = 0
    threads: int = 0
    report: RunReport | None = None  # its batches folded together; the latest batch's plan

    def add(self, batch: dict) -> None:
        part = RunReport(**{k: v for k, v in batch.items() if k in RunReport.__dataclass_fields__})
        part.load_seconds = 0.0  # a replica loads once; its load time rides on every batch's report
        if self.report is None:
            self.report = part
        else:
            self.report.absorb(part)
            if part.batch_size:
                self.report.batch_size, self.report.micro_batch_size = part.batch_size, part.micro_batch_size
                self.report.policy, self.report.prediction = part.policy, part.prediction
            self.report.requests += part.requests
        self.report.load_seconds = batch.get("load_seconds", 0.0)
        self.report.attention_backend = self.report.attention_backend or part.attention_backend
        self.batches += 1
        self.threads = batch.get("threads", self.threads)

    def to_dict(self) -> dict:
        r = self.report
        return {"replica": self.replica, "batches": self.batches, "threads": self.threads, "requests": r.requests,
                "prompt_tokens": r.prompt_tokens, "prefill_computed_tokens": r.prefill_computed_tokens,
                "generated_tokens": r.generated_tokens,
                "decode_tokens": r.decode_tokens, "prefill_seconds": r.prefill_seconds,
                "decode_seconds": r.decode_seconds, "load_seconds": r.load_seconds,
                "attention_backend": r.attention_backend, "peak_memory_bytes": r.peak_memory_bytes,
                "batch_size": r.batch_size, "micro_batch_size": r.micro_batch_size, "policy": r.policy,
                "prediction": r.prediction, "prefill_tokens_per_s": r.prefill_tokens_per_s,
                "decode_tokens_per_s": r.decode_tokens_per_s}


@dataclass
class RayRunReport(RunReport):
    ray_address: str = ""
    wall_seconds: float = 0.0
    replicas: list = field(default_factory=list)  # ReplicaFigures.to_dict() per replica

    def fold(self, figures: dict[str, ReplicaFigures], stage_seconds: float) -> None:
        """Totals from the replicas' reports; the replicas' rates summed; the stage's wall time for end-to-end."""
        reps = [f for f in figures.values() if f.report is not None]
        self.replicas = [r.to_dict() for r in reps]
        requests, skipped, listed = self.requests, self.skipped_requests, self.skipped
        for r in reps:
            self.absorb(r.report)
        self.requests, self.skipped_requests, self.skipped = requests, skipped, listed  # the driver counted them
        self.generation_seconds = stage_seconds
        self.load_seconds = max((r.report.load_seconds for r in reps), default=0.0)
        self.update_rates()
        self.prefill_tokens_per_s = sum(r.report.prefill_tokens_per_s for r in reps)
        self.decode_tokens_per_s = sum(r.report.decode_tokens_per_s for r in reps)
        if reps:
            first = reps[0].report
            self.batch_size, self.micro_batch_size = first.batch_size, first.micro_batch_size
            self.policy, self.prediction = dict(first.policy), dict(first.prediction)
            self.attention_backend = first.attention_backend

    def summary(self) -> str:
        lines = [super().summary().replace(" s loading)", " s loading, on the slowest replica)"),
                 f"ray           {len(self.replicas)} replica(s) at {self.ray_address}, "
                 f"{self.wall_seconds:.2f} s wall for the whole job"]
        for r in self.replicas:
            lines.append(f"  {r['replica']}: {r['requests']} requests in {r['batches']} batch(es) of <= "
                         f"{r['batch_size']}, {r['threads']} threads, prefill {r['prefill_tokens_per_s']:.1f} "
                         f"tok/s, decode {r['decode_tokens_per_s']:.1f} tok/s, load {r['load_seconds']:.2f} s")
        return "\n".join(lines)
