"""The record of the job an output belongs to (`OUTPUT.job.json`), so `--resume` continues only its
own job: the dataset, the output's format, the options that change results, and one short hash per
request (its prompt, turns and sampling fields). `--dtype auto` is recorded as the dtype it resolves to, so
`--dtype bfloat16` resumes a job that ran in bfloat16 by `auto` (an older record's 'auto' is read so too).

The record is written (atomically) just before the output's first result, and again with every
new request when a resumed job adds to it. `--resume` compares it with the job at hand before any
model loads and refuses another job's output, saying what differs; requests whose prompt changed
under an id the output already holds are named. An output without a record (an older moelight's,
or another tool's) is resumed only when its records have the output's shape, with a warning that
its options and prompts could not be checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moelight.errors import MoelightError
from moelight.jobs.atomic_write import write_text_atomic
from moelight.loading.hub_cache import cached_model_folder

REFUSED = "refused"  # the hash of an OpenAI record refused at read: the output's error line answers it
VERSION = 2  # 2: a request's hash covers its sampling fields (stop, n, logprobs, response_format, ...)
# RunOptions fields that change what a request generates (batching and placement do not, in float32)
# (which requests a job holds is the requests' business: each is checked by its hash)
RESULT_OPTIONS = ("model", "load_format", "dtype", "quantize", "tokenizer", "seed", "gen_len", "temperature",
                  "top_p", "top_k", "ignore_eos", "turn")
_REQUEST_FIELDS = ("prompt", "messages", "followups", "tools", "max_new_tokens", "temperature", "top_p", "top_k",
                   "seed")
_REQUEST_FIELDS_V2 = (*_REQUEST_FIELDS, "sampling")


class ResumeError(MoelightError):
    """An output that `--resume` must not continue: another job's, or one whose prompts changed."""


def record_path(output: Path) -> Path:
    return output.with_name(output.name + ".job.json")


def request_hash(request, version: int = VERSION) -> str:
    """What a request asks, in 16 hex digits: its prompt or messages, later turns, tools, sampling and chat
    template arguments (`version` 1, an older record's: without the sampling dict's fields)."""
    if version < 2:
        body = json.dumps({k: getattr(request, k) for k in _REQUEST_FIELDS}, sort_keys=True, default=str)
    else:
        fields = [_canonical(getattr(request, k)) for k in _REQUEST_FIELDS_V2]
        chat = getattr(request, "chat_options", None)
        if chat:  # only when set, so a request without them hashes as it did before they were read
            fields.append(_canonical(chat))
        body = json.dumps(fields, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def _canonical(value, keep_order: bool = False):
    """`value` with its objects' keys sorted (where a field sits in a record does not change the request),
    except a JSON schema's `properties`, whose order is the order the grammar writes the fields and
    the chat template shows a tool's parameters; a schema's `required` names as a set."""
    if isinstance(value, dict):
        keys = list(value) if keep_order else sorted(value, key=str)
        return [[str(k), sorted(map(str, value[k])) if k == "required" and isinstance(value[k], list)
                 else _canonical(value[k], keep_order=k == "properties")] for k in keys]
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


def _content(identity) -> str | None:
    """What a model folder's identity says of its content (config.json and a sample of its weights), None
    for a preset, a spec, or an older record's identity (the path was all of it then)."""
    found = re.search(r"\((config\.json [0-9a-f]{16}, weights [0-9a-f]{16})\)$", str(identity or ""))
    return found.group(1) if found else None


def _weights_sample(folder: Path) -> str:
    """16 hex digits of the weight files' sizes and 4 KiB from the middle and the end of each: a copy of
    the checkpoint at another path has the same, a fine-tune of it (the same config.json) another."""
    digest = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        if not f.is_file():  # a link an interrupted download left: the weight check names it
            digest.update(f"{f.name} absent".encode())
            continue
        size = f.stat().st_size
        digest.update(f"{f.name} {size}".encode())
        with open(f, "rb") as fh:
            for at in (size // 2, max(0, size - 4096)):
                fh.seek(at)
                digest.update(fh.read(4096))
    return digest.hexdigest()[:16]


def _model_identity(model: str) -> str:
    """A model folder by its path, config.json and weights (`_weights_sample`); a preset or CoE spec by its
    name / content."""
    path = cached_model_folder(model)
    if path.is_dir() and (path / "config.json").is_file():
        digest = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()[:16]
        return f"{os.path.abspath(path)} (config.json {digest}, weights {_weights_sample(path)})"
    target = path
    if target.is_file():
        digest = hashlib.sha256(target.read_bytes()).hexdigest()[:16]
        return f"{os.path.abspath(path)} ({target.name} {digest})"
    return model


def _auto_dtype(opts) -> str | None:
    """What --dtype auto runs the job's model in: a preset's bfloat16 or a folder's config.json dtype, made
    float16 on a GPU without bfloat16 arithmetic as the session makes it; None where the job's start will
    say why it cannot tell (a CoE spec: each entry its own)."""
    from moelight.loading.model_source import resolve_model
    from moelight.planning.hardware_choice import cuda_dtype_advice, resolve_device

    try:
        name = str(resolve_model(opts.model, opts.load_format, "auto").dtype).replace("torch.", "")
        if resolve_device(opts.device) == "cuda":
            import torch

            name = cuda_dtype_advice("auto", name, torch.cuda.get_device_capability())[0] or name
        return name
    except (MoelightError, OSError, ValueError):
        return None


@dataclass
class JobRecord:
    dataset: str
    output_format: str
    settings: dict
    requests: dict[str, str] | None = None  # id -> request_hash; None where the driver never saw them all
    version: int = VERSION
    extra: dict = field(default_factory=dict)

    @classmethod
    def of_job(cls, opts, output_format: str, requests=None) -> JobRecord:
        settings = {k: getattr(opts, k) for k in RESULT_OPTIONS}
        settings["model"] = _model_identity(opts.model)
        auto = _auto_dtype(opts)
        if opts.dtype == "auto" and auto is not None:  # the dtype it runs in, not its spelling
            settings["dtype"] = auto
        hashes = None if requests is None else {r.id: request_hash(r) for r in requests}
        record = cls(os.path.abspath(Path(opts.dataset).expanduser()), output_format, settings, hashes)
        record._requests = requests  # to hash as an older record did (`hashes_of_version`)
        record._auto_dtype = auto  # what an older record's 'auto' was, for this model
        return record

    def hashes_of_version(self, version: int) -> dict[str, str] | None:
        """This job's request hashes as a record of `version` wrote them."""
        if version == self.version or getattr(self, "_requests", None) is None:
            return self.requests
        return {r.id: request_hash(r, version) for r in self._requests}

    @classmethod
    def load(cls, path: Path) -> JobRecord:
        try:
            d = json.loads(path.read_text())
            record = cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
            record._check_types()
            return record
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            raise ResumeError(f"{path}: not a moelight job record ({e}); remove it to resume without the "
                              "checks, or pass --overwrite to start the output again") from None

    def _check_types(self) -> None:
        """What `--resume` reads, of the types it was written with (a hand-edited record fails here, not
        after the job has generated)."""
        if not isinstance(self.dataset, str) or not isinstance(self.output_format, str):
            raise TypeError("'dataset' and 'output_format' must be strings")
        if not isinstance(self.settings, dict) or "model" not in self.settings:
            raise TypeError("'settings' must be an object of the job's options, the model among them")
        if self.requests is not None and not (isinstance(self.requests, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.requests.items())):
            raise TypeError("'requests' must map request ids to hashes")
        if not isinstance(self.extra, dict):
            raise TypeError("'extra' must be an object")
        if not isinstance(self.version, int) or not 1 <= self.version <= VERSION:
            raise TypeError(f"version {self.version!r}: this moelight reads records of versions 1 to {VERSION} "
                            "(a newer moelight's record hashes requests another way)")

    def save(self, path: Path) -> None:
        """Atomically, so a killed job never leaves half a record."""
        write_text_atomic(path, json.dumps(asdict(self), indent=1, sort_keys=True) + "\n")

    def merged(self, other: JobRecord) -> JobRecord:
        """This record with `other`'s requests added (a resumed job that brings new ones)."""
        if self.requests is None or other.requests is None:
            return self
        if self.version < other.version:  # an older record's hashes give way to the job's (checked equal)
            return JobRecord(self.dataset, self.output_format, self.settings, other.requests, other.version)
        return JobRecord(self.dataset, self.output_format, self.settings, self.requests | other.requests)

    def differences(self, now: JobRecord) -> list[str]:
        """What makes `now` another job than the one this record belongs to."""
        out = []
        if self.output_format != now.output_format:
            out.append(f"output format: the output holds {self.output_format} records, this job writes "
                       f"{now.output_format}")
        for k, was in self.settings.items():
            if now.settings.get(k) != was and not (k == "model" and self.same_model(now)) and not (
                    k == "dtype" and was == "auto" and now.settings.get(k) == getattr(now, "_auto_dtype", None)):
                out.append(f"--{k.replace('_', '-')}: was {was!r}, now {now.settings.get(k)!r}")
        return out

    def same_model(self, now: JobRecord) -> bool:
        """The checkpoint moved (`model_moved`), or an older record names it by path and config.json only."""
        was, is_now = str(self.settings.get("model")), str(now.settings.get("model"))
        return self.model_moved(now) or re.sub(r", weights [0-9a-f]{16}\)$", ")", is_now) == was

    def model_moved(self, now: JobRecord) -> bool:
        """The same checkpoint (config.json and weights) at another path: a node-local copy, a link."""
        was, is_now = (_content(r.settings.get("model")) for r in (self, now))
        return was is not None and was == is_now and self.settings.get("model") != now.settings.get("model")

    def unrecorded(self, now: JobRecord) -> list[str]:
        """Options this job records that the output's record does not (an older moelight's): not checked."""
        return [k for k in now.settings if k not in self.settings]

    def changed(self, now: JobRecord, ids: set[str]) -> tuple[list[str], list[str]]:
        """(ids whose request changed, ids the output holds that the job no longer has), among `ids`."""
        theirs = now.hashes_of_version(self.version)
        if self.requests is None or theirs is None:
            return [], []
        changed = sorted(i for i in ids if i in self.requests and i in theirs and self.requests[i] != theirs[i])
        gone = sorted(i for i in ids if i not in now.requests)
        return changed, gone


def check_resume(output: Path, now: JobRecord, done: set[str], output_shape: str | None) -> list[str]:
    """Raise ResumeError if the output at `output` belongs to another job; return warnings to report.
    `output_shape`: the format of the output's first record ("openai" or "jsonl"; None: empty)."""
    path = record_path(output)
    if not path.exists():
        if output_shape is not None and output_shape.startswith("not results"):
            raise ResumeError(f"--resume {output}: {output_shape}: it is not a results file (a dataset?), and "
                              "resuming would count its ids as finished and append to it. Name another --output, "
                              "or pass --overwrite to replace it")
        if output_shape is not None and now.output_format != "parquet" and output_shape != now.output_format:
            raise ResumeError(f"--resume {output}: its records are in the {output_shape} shape and this job writes "
                              f"{now.output_format}: it is another job's output. Name another --output, or "
                              "pass --overwrite to replace it")
        return [f"{output} has no job record ({path.name}): the output was written by an older moelight or "
                "another tool, so its options and prompts could not be checked against this job"]
    record = JobRecord.load(path)
    problems = record.differences(now)
    changed, gone = record.changed(now, done)
    if changed:
        problems.append(f"{len(changed)} request(s) the output holds changed under the same id: "
                        + ", ".join(changed[:10]) + (" ..." if len(changed) > 10 else ""))
    if gone:
        problems.append(f"{len(gone)} id(s) in the output are not in this job: "
                        + ", ".join(gone[:10]) + (" ..." if len(gone) > 10 else ""))
    if problems:
        raise ResumeError(f"--resume {output}: the output belongs to another job ({path.name}):\n  "
                          + "\n  ".join(problems)
                          + "\nname another --output for this job, or pass --overwrite to replace that output")
    notes = []
    missing = record.unrecorded(now)
    if missing:
        notes.append(f"{path.name} does not record " + ", ".join(f"--{k.replace('_', '-')}" for k in missing)
                     + ": the output's values of these could not be checked against this job")
    if record.version < 2 and record.requests is not None:
        notes.append(f"{path.name} predates the check of requests' sampling fields (stop, n, logprobs, "
                     "response_format, ...): a change to those in the finished requests could not be detected")
    if record.model_moved(now):
        notes.append(f"the model folder moved: the output was started from {record.settings['model']}, this job "
                     f"reads {now.settings['model']} (the same config.json and weights)")
    if record.dataset != now.dataset:
        notes.append(f"the dataset moved: the output was started from {record.dataset}, this job reads "
                     f"{now.dataset} (its requests match)")
    return notes


def output_shape(output: Path) -> str | None:
    """The shape of an existing output's records, by its first one: "openai" (OpenAI batch lines), "jsonl"
    (moelight results: an id and an output or an error), "parquet"; "not results (line N ...)" for a record of
    neither shape (a prompt file); None when it holds none."""
    if output.suffix.lower() in (".parquet", ".pq"):
        return "parquet"
    try:
        with open(output, "rb") as f:
            for n, raw in enumerate(f, start=1):
                if raw.strip():
                    obj = json.loads(raw)
                    if isinstance(obj, dict) and "custom_id" in obj and "response" in obj:
                        return "openai"
                    if isinstance(obj, dict) and "id" in obj and ("output" in obj or "error" in obj):
                        return "jsonl"
                    keys = ", ".join(sorted(map(str, obj))) if isinstance(obj, dict) else type(obj).__name__
                    return f"not results (line {n} has no 'output' or 'error' field; keys: {keys or 'none'})"
    except (OSError, ValueError):
        return None
    return None
