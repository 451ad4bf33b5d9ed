"""The options of a dataset job: the engine's, plus the requests' source, their sampling defaults,
the output and how to run (locally, as a CoE job, on Ray)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import workloads
from moelight.engine.options import EngineOptions, OptionError
from moelight.jobs.output_file import output_companions
from moelight.jobs.path_checks import check_output_file
from moelight.loading.hub_cache import cached_model_folder


@dataclass(kw_only=True)
class RunOptions(EngineOptions):
    """A dataset job: the engine's options plus the requests' source, their sampling and the output."""

    dataset: Path
    output: Path
    gen_len: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    ignore_eos: bool = False
    turn: int = 1
    num_requests: int | None = None
    dataset_format: str | None = None
    prompt_column: str = "prompt"
    skip_bad_lines: bool = False
    resume: bool = False
    overwrite: bool = False
    progress: bool = True
    coe_order: str = "grouped"  # a CoE job (--model coe.json): grouped by model (CoServe) or fcfs
    ray: str | None = None  # run on Ray (moelight/jobs/ray): "local" starts a cluster, "auto" / an address connects
    ray_replicas: str = "1"  # engines (actors): a count, or MIN-MAX for an autoscaling pool
    ray_cpus_per_replica: float | None = None  # None: the cluster's CPUs shared by the pool's maximum
    ray_gpus_per_replica: float = 0.0
    log: Callable[[str], None] | None = None  # one-line notes (the plan, a fresh profile)

    def validate(self) -> None:
        """Every option, the output's extension and the dataset format included, before any reading."""
        super().validate()
        if self.tokenizer == "none":
            raise OptionError("--tokenizer none: a dataset job reads and writes text; use auto, hf or byte")
        if self.resume and self.overwrite:
            raise OptionError("--resume and --overwrite contradict each other: choose one")
        if self.coe_order not in ("grouped", "fcfs"):  # checked for every job, as every option is
            raise OptionError(f"--coe-order {self.coe_order!r} is not one of the valid choices: grouped, fcfs")
        if self.coe_order != "grouped" and not is_coe_spec(self.model):
            raise OptionError(f"--coe-order {self.coe_order}: orders a CoE job's requests (--model coe.json); "
                              f"--model {self.model} is one model: drop it")
        if self.dataset_format is not None and self.dataset_format not in workloads.FORMATS:
            raise OptionError(f"--format {self.dataset_format!r} is not one of the valid choices: "
                              f"{', '.join(workloads.FORMATS)}")
        try:
            workloads.output_format(self.output)
        except workloads.OutputPathError as e:
            raise OptionError(f"--output {e}") from None
        self._check_sampling()
        if self.ray is not None:
            self._check_ray()
        else:
            self._check_no_ray_options()
        from moelight.parallel.rank_group import torchrun_rank

        if torchrun_rank() is not None and (self.ray is not None or is_coe_spec(self.model)):
            raise OptionError("torchrun starts the ranks of one tensor-parallel model: run a CoE spec or --ray "
                              "without torchrun")
        check_output_file(self.output, "--output", self.inputs(), companions=output_companions(self.output))

    def inputs(self) -> list[tuple[str, Path]]:
        """Everything the job reads, by what it is: an output may be none of them, nor inside one."""
        reads: list[tuple[str, Path]] = [("dataset", Path(self.dataset))]
        model = Path(self.model).expanduser()
        if is_coe_spec(self.model):
            reads.append(("CoE spec", model))
            reads += [(f"model folder of CoE entry {name!r}", Path(m).expanduser())
                      for name, m in coe_model_paths(model).items() if Path(m).expanduser().exists()]
        elif cached_model_folder(self.model).exists():
            reads.append(("model folder", cached_model_folder(self.model)))
        for what, value in (("policy file", self.policy if self.policy != "auto" else None),
                            ("hardware profile", self.hardware), ("EAM collection", self.eamc),
                            ("predictor file", self.predictor)):
            if value is not None and Path(value).expanduser().exists():
                reads.append((what, Path(value).expanduser()))
        return reads

    def _check_sampling(self) -> None:
        """The requests' sampling defaults, named as options (a request's own values are checked with its line)."""
        if self.temperature < 0:
            raise OptionError(f"--temperature {self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise OptionError(f"--top-p {self.top_p}: must be in (0, 1] (1 = off)")
        if self.top_k < -1:
            raise OptionError(f"--top-k {self.top_k}: must be 0 or -1 (off) or a positive count")

    def _check_no_ray_options(self) -> None:
        """A --ray-* option without --ray would be ignored: say so instead."""
        given = [option for option, value, default in (
            ("--ray-replicas", self.ray_replicas, "1"), ("--ray-cpus-per-replica", self.ray_cpus_per_replica, None),
            ("--ray-gpus-per-replica", self.ray_gpus_per_replica, 0.0)) if value != default]
        if given:
            raise OptionError(f"{', '.join(given)} only apply to a Ray job: add --ray (a local Ray cluster) or "
                              f"--ray ADDRESS, or leave {'them' if len(given) > 1 else 'it'} out")

    def _check_ray(self) -> None:
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise OptionError('--ray needs Ray Data: pip install -e ".[ray]" (or pip install "ray[data]")')
        parse_replicas(self.ray_replicas)
        if is_coe_spec(self.model):
            raise OptionError("--ray runs one model per replica; a CoE spec (--model coe.json) runs locally only")
        if (self.gpus or 0) > 1:
            raise OptionError(f"--ray with --gpus {self.gpus}: a replica runs on one device; give each replica "
                              "one GPU (--ray-gpus-per-replica 1) and more replicas instead")
        for option, value in (("--ray-cpus-per-replica", self.ray_cpus_per_replica),
                              ("--ray-gpus-per-replica", self.ray_gpus_per_replica)):
            if value is not None and value < 0:
                raise OptionError(f"{option} {value}: must be >= 0")


def is_coe_spec(model: str) -> bool:
    path = Path(model)
    return path.suffix.lower() == ".json" and path.is_file()


def parse_replicas(text: str) -> tuple[int, int]:
    """'N' (a fixed pool) or 'MIN-MAX' (an autoscaling pool) -> (min, max)."""
    try:
        lo, _, hi = str(text).partition("-")
        bounds = (int(lo), int(hi or lo))
    except ValueError:
        raise OptionError(f"--ray-replicas {text!r}: give a count (2) or bounds for autoscaling (1-4)") from None
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise OptionError(f"--ray-replicas {text!r}: need 1 <= MIN <= MAX")
    return bounds


def coe_model_paths(spec: Path) -> dict[str, str]:
    """A CoE spec's models by name, read leniently (coe_job.CoESpec.load says what is wrong with it)."""
    import json

    try:
        models = json.loads(spec.read_text()).get("models")
    except (OSError, ValueError, AttributeError):
        return {}
    return {k: v for k, v in models.items() if isinstance(v, str)} if isinstance(models, dict) else {}
