"""moelight as a Ray Data stage, in the shape of Ray Data LLM's processors:

    import ray
    from moelight.ray import ProcessorConfig, build_processor

    config = ProcessorConfig(model="tiny", engine_options={"load_format": "dummy"}, replicas=2,
                             sampling={"gen_len": 32})
    processor = build_processor(config, preprocess=lambda row: {"prompt": row["question"]},
                                postprocess=lambda row: {"question_id": row["id"], "answer": row["generated_text"]})
    answers = processor(ray.data.read_parquet("questions.parquet"))
    answers.write_parquet("answers/")

A row (after `preprocess`) is a request in moelight's jsonl shape: `prompt` or `messages`, and
optionally `id`, `max_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `tools`, `followups`,
`chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`.
Rows without an id get one (a uuid). The output rows hold `id`, `generated_text`,
`output_token_ids`, `finish_reason`, `prompt_tokens`, `completion_tokens`, `replica` and `details`
(the rest of the local run's output record — prompt, messages, turns, meta — as JSON), then
whatever `postprocess` makes of them.

A request that cannot be generated (a prompt longer than the context, a sampling field out of
range) fails the dataset with an error listing the bad rows of its batch, unless
`should_continue_on_error` is set (Ray Data LLM's option): then it comes back as a row with its
error in `__inference_error__` ("" on every answered row), past `postprocess` as Ray Data LLM's
error rows go, and the other rows are answered. Requests and results travel as Arrow rows, as in
`moelight run --ray` (moelight/jobs/ray/).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from moelight.engine.options import EngineOptions, OptionError
from moelight.jobs.ray.replica import ERROR_COLUMN, MoelightReplica

BAD_ROW_REMEDY = ("set ProcessorConfig(should_continue_on_error=True) to answer the other rows and get these back "
                  f"with their error in {ERROR_COLUMN}")
SAMPLING_KEYS = ("gen_len", "temperature", "top_p", "top_k", "ignore_eos")


@dataclass
class ProcessorConfig:
    """What each replica runs and how many there are."""

    model: str
    engine_options: dict = field(default_factory=dict)  # EngineOptions fields: dtype, load_format, device, ...
    sampling: dict = field(default_factory=dict)  # defaults for rows that set none: gen_len, temperature, ...
    replicas: int | tuple[int, int] = 1  # a fixed pool, or (min, max) to autoscale
    num_cpus: float = 1.0  # per replica; a CPU replica runs that many torch threads
    num_gpus: float = 0.0  # per replica
    batch_size: int = 256  # requests per replica call (one planned job)
    should_continue_on_error: bool = False  # a bad row comes back with its error in __inference_error__

    def run_fields(self) -> dict:
        """RunOptions fields for a replica (dataset and output are the driver's business)."""
        unknown = sorted(set(self.engine_options) - set(EngineOptions.names()))
        if unknown:
            raise OptionError(f"ProcessorConfig.engine_options: unknown {', '.join(unknown)}; valid: "
                              f"{', '.join(n for n in EngineOptions.names() if n != 'model')}")
        bad = sorted(set(self.sampling) - set(SAMPLING_KEYS))
        if bad:
            raise OptionError(f"ProcessorConfig.sampling: unknown {', '.join(bad)}; valid: {', '.join(SAMPLING_KEYS)}")
        from pathlib import Path

        from moelight.jobs.run_options import RunOptions

        opts = RunOptions(model=self.model, dataset=Path("-"), output=Path("-.jsonl"), progress=False,
                          **self.engine_options, **self.sampling)
        EngineOptions.validate(opts)
        from moelight.jobs.ray.ray_job import opts_fields

        return opts_fields(opts)


def _to_request_rows(batch: dict) -> dict:
    """Rows in moelight's jsonl shape -> request rows, parsed by the local jsonl parser."""
    from workloads.readers import parse_prompt_record

    keys = list(batch)
    n = len(batch[keys[0]]) if keys else 0
    rows = []
    for i in range(n):
        obj = {k: _plain(batch[k][i]) for k in keys}
        obj = {k: v for k, v in obj.items() if v is not None}
        obj.setdefault("id", uuid.uuid4().hex)
        rows.append(parse_prompt_record(obj, f"row id {obj['id']}", i + 1).to_row())
    return {k: [r[k] for r in rows] for k in (rows[0] if rows else ())}


def _plain(v):
    """numpy scalars / arrays from a Ray batch -> plain Python values."""
    if hasattr(v, "tolist"):
        return v.tolist()
    return v


def _to_output_rows(batch: dict) -> dict:
    out = {"id": batch["id"], "generated_text": batch["output"], "output_token_ids": batch["output_token_ids"],
           "finish_reason": batch["finish_reason"], "prompt_tokens": batch["prompt_tokens"],
           "completion_tokens": batch["completion_tokens"], "replica": batch["replica"], "details": batch["details"]}
    if ERROR_COLUMN in batch:
        out[ERROR_COLUMN] = batch[ERROR_COLUMN]
    return out


def _postprocess_answers(postprocess: Callable[[dict], dict]) -> Callable[[dict], dict]:
    """`postprocess` on answered rows; an error row passes as it is (it has no answer to shape)."""

    def run(row: dict) -> dict:
        if row.get(ERROR_COLUMN):
            return row
        out = postprocess(row)
        return out | {ERROR_COLUMN: ""} if ERROR_COLUMN in row else out

    return run


class Processor:
    """Callable on a ray.data.Dataset: returns the dataset of answers (lazy, as Ray Data is)."""

    def __init__(self, config: ProcessorConfig, preprocess: Callable[[dict], dict] | None = None,
                 postprocess: Callable[[dict], dict] | None = None) -> None:
        self.config, self.preprocess, self.postprocess = config, preprocess, postprocess
        self.fields = config.run_fields()

    def __call__(self, ds):
        from ray.data import ActorPoolStrategy

        c = self.config
        lo, hi = c.replicas if isinstance(c.replicas, tuple) else (c.replicas, c.replicas)
        # the conversions are light: num_cpus=0 lets them run beside a pool that holds every CPU, and one
        # task at a time keeps Ray from starting a worker process (each importing torch) per block
        light = {"num_cpus": 0, "concurrency": 1}
        if self.preprocess is not None:
            ds = ds.map(self.preprocess, **light)
        ds = ds.map_batches(_to_request_rows, batch_format="numpy", **light)
        replica_kwargs = {"opts_fields": self.fields, "num_cpus": c.num_cpus, "error_rows": c.should_continue_on_error,
                          "bad_row_remedy": BAD_ROW_REMEDY}
        out = ds.map_batches(MoelightReplica, fn_constructor_kwargs=replica_kwargs,
                             batch_size=c.batch_size, batch_format="pyarrow",
                             compute=ActorPoolStrategy(min_size=lo, max_size=hi, max_tasks_in_flight_per_actor=1),
                             num_cpus=c.num_cpus, num_gpus=c.num_gpus)
        out = out.map_batches(_to_output_rows, batch_format="numpy", **light)
        if self.postprocess is not None:
            out = out.map(_postprocess_answers(self.postprocess), **light)
        return out


def build_processor(config: ProcessorConfig, preprocess: Callable[[dict], dict] | None = None,
                    postprocess: Callable[[dict], dict] | None = None) -> Processor:
    """A processor for `config`; options are checked now, the model loads on each replica at run time."""
    return Processor(config, preprocess, postprocess)
