"""A job's requests: the dataset read and checked (every bad record with file:line, before any
model loads), less what a resumed output already holds, and the state of the output it goes to."""

from __future__ import annotations

from dataclasses import dataclass, field

import workloads
from moelight.jobs.output_file import OutputState, prepare_output
from moelight.jobs.run_options import RunOptions


@dataclass
class JobInput:
    requests: list  # what is left to generate
    skipped: list[str]  # bad records skipped (--skip-bad-lines), "file:line: why"
    out_format: str
    output: OutputState
    refused: dict[str, str] = field(default_factory=dict)  # custom_id -> why, of OpenAI records refused at read


def read_requests(opts: RunOptions) -> JobInput:
    """The dataset's requests less those a resumed output already holds; the output's state."""
    loaded = workloads.load_dataset(
        opts.dataset, opts.dataset_format, turn=opts.turn, num_requests=opts.num_requests,
        skip_bad_lines=opts.skip_bad_lines, prompt_column=opts.prompt_column, hint_style="cli",
    )
    out_format = workloads.output_format(opts.output, loaded.format)
    refused = {p.id: str(p) for p in loaded.skipped if p.id is not None}
    state = prepare_output(opts, out_format, loaded.requests, refused)
    state.notes += loaded.warnings  # the report's warnings
    left = [r for r in loaded.requests if r.id not in state.done]
    refused = {cid: why for cid, why in refused.items() if cid not in state.done}
    return JobInput(left, [str(p) for p in loaded.skipped], out_format, state, refused)
