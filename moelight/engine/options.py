"""The options of a moelight engine, shared by `moelight run` and the Python `LLM`.

One dataclass so the two front ends cannot drift apart, and one `validate()` that checks
every choice before anything heavy happens (dataset read, model resolved, weights loaded):
a typo costs a second, not a model load.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from moelight.errors import OptionError
from moelight.expert_cache.policy_registry import NEEDS_PREDICTOR, PREFETCHING
from moelight.expert_cache.policy_registry import POLICIES as CACHE_POLICIES
from moelight.loading.load_formats import LOAD_FORMATS
from moelight.pipeline.schedule import SCHEDULES

DEVICES = ("auto", "cpu", "cuda", "emulated")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
TOKENIZERS = ("auto", "hf", "byte", "none")  # none: LLM(skip_tokenizer_init=True), token ids only
MODES = ("auto", "throughput", "latency")
# routed experts: as loaded, int8 per channel, or int4 in groups of 128 (or 64 / 32) input channels
QUANTIZE = ("none", "int8", "int4", "int4-g64", "int4-g32")


def quantization(quantize: str) -> tuple[str, int]:
    """(method, int4 group size) of a QUANTIZE value, 'int4-g64' -> ('int4', 64): run and plan read it alike."""
    method, _, group = quantize.partition("-g")
    return method, int(group or 128)


def _choice(option: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise OptionError(f"{option} {value!r} is not one of the valid choices: {', '.join(valid)}")


@dataclass
class EngineOptions:
    """How to load, plan and run a model: everything but the requests and where results go."""

    model: str
    load_format: str = "auto"
    dtype: str = "auto"
    tokenizer: str = "auto"  # TOKENIZERS, or a folder to load it from (vLLM's tokenizer path)
    seed: int = 0  # request r samples with seed + crc32(r's id) unless its SamplingParams has a seed
    policy: str = "auto"  # "auto" (plan with the HRM) or a policy JSON (`moelight plan --save-policy`)
    hardware: str | None = None  # preset, "profile" or a JSON path; None: the cached (or a quick) profile
    gpus: int | None = None  # GPUs the plan may use (None: what the hardware spec says)
    device: str = "auto"  # cpu (plain executor), cuda or emulated (CGOPipe runtime); auto: cuda if present
    schedule: str = "cgopipe"  # pipeline schedule on cuda/emulated
    refill: bool = True  # refill freed KV slots with waiting requests; False: static batches of N (the paper's)
    enable_prefix_caching: bool = True  # vLLM's name: page the KV cache and compute shared prefixes once
    batch_size: int | None = None  # override the policy's N
    micro_batch_size: int | None = None  # override the policy's micro-batch size
    max_prefill_tokens: int = 4096  # tokens per prefill pass
    mode: str = "auto"  # throughput (CGOPipe), latency (a device expert cache), auto: the faster by the HRM
    cache_policy: str = "auto"  # latency mode's expert cache (policy_registry.POLICIES); auto: cache_policy_name()
    cache_size: float | None = None  # expert slots: a share of all experts (< 1) or a count; None: what fits
    eamc: str | None = None  # MoE-Infinity's EAM collection (`moelight eamc`)
    prefetch_per_layer: int | None = None  # prefetches per layer pass; None: the policy's own, else the link's
    predictor: str | None = None  # ProMoE / DuoServe / CoServe's file (`moelight train-predictor`)
    quantize: str = "none"  # routed experts quantized at load (QUANTIZE); attention and embeddings stay 16-bit

    def quantization(self) -> tuple[str, int]:
        """(method, int4 group size) of --quantize: ('none' | 'int8' | 'int4', group)."""
        return quantization(self.quantize)

    def cache_policy_name(self) -> str:
        """auto: MoE-Infinity where an EAM collection is given (`--eamc`: the one policy that reads it),
        else the combined policy (CPU execution of small misses, an LFU cache filled in the
        background), the fastest of the policies that need no trained file on held-out traces
        (BENCHMARKS.md section 9)."""
        if self.cache_policy == "auto":
            return "moe-infinity" if self.eamc is not None else "combined"
        return self.cache_policy

    def validate(self) -> None:
        """Raise OptionError for the first option that cannot work; touches no weights."""
        _choice("--load-format", self.load_format, LOAD_FORMATS)
        _choice("--dtype", self.dtype, DTYPE_CHOICES)
        if self.tokenizer not in TOKENIZERS and not Path(self.tokenizer).expanduser().is_dir():
            raise OptionError(f"--tokenizer {self.tokenizer!r} is neither a folder nor one of the valid choices: "
                              f"{', '.join(TOKENIZERS)}; a tokenizer's folder holds its tokenizer.json (a Hub id "
                              "is not looked up)")
        _choice("--device", self.device, DEVICES)
        _choice("--schedule", self.schedule, SCHEDULES)
        if self.device == "cpu" and self.schedule != "cgopipe":
            raise OptionError(f"--schedule {self.schedule}: a pipeline schedule runs on --device cuda or emulated; "
                              "the CPU engine (--device cpu) runs none: drop it, or give --device emulated")
        _choice("--mode", self.mode, MODES)
        _choice("--cache-policy", self.cache_policy, ("auto", *CACHE_POLICIES))
        _choice("--quantize", self.quantize, QUANTIZE)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise OptionError(f"--seed {self.seed!r}: a whole number (request r samples with seed + crc32(r's id))")
        bounds = (("--batch-size", self.batch_size, 1), ("--micro-batch-size", self.micro_batch_size, 1),
                  ("--gpus", self.gpus, 0), ("--max-prefill-tokens", self.max_prefill_tokens, 1),
                  ("--prefetch-per-layer", self.prefetch_per_layer, 0))
        for option, value, low in bounds:
            if value is not None and value < low:
                raise OptionError(f"{option} {value}: must be >= {low}")
        if self.cache_size is not None and (self.cache_size <= 0 or (self.cache_size >= 1 and self.cache_size % 1)):
            raise OptionError(f"--cache-size {self.cache_size}: a share of the experts in (0, 1) or a whole "
                              "number of slots")
        if self.eamc is not None and not Path(self.eamc).expanduser().is_file():
            raise OptionError(f"--eamc {self.eamc}: no such file; build one with `moelight eamc --trace TRACE`")
        if self.cache_policy == "moe-infinity" and self.eamc is None:
            raise OptionError("--cache-policy moe-infinity needs --eamc FILE (`moelight eamc --trace TRACE`)")
        if self.predictor is not None and not Path(self.predictor).expanduser().is_file():
            raise OptionError(f"--predictor {self.predictor}: no such file; train one with `moelight train-predictor`")
        if self.predictor is not None and self.cache_policy not in NEEDS_PREDICTOR:
            raise OptionError(f"--predictor {self.predictor}: only --cache-policy promoe, duoserve or coserve reads "
                              f"one; name the policy it was trained for")
        if self.eamc is not None and self.cache_policy not in ("auto", "moe-infinity"):
            raise OptionError(f"--eamc {self.eamc}: only --cache-policy moe-infinity reads it (auto takes it "
                              f"when --eamc is given); --cache-policy {self.cache_policy} would leave it unused")
        if self.cache_policy in NEEDS_PREDICTOR and self.predictor is None:
            raise OptionError(f"--cache-policy {self.cache_policy} needs --predictor FILE "
                              f"(`moelight train-predictor --kind {self.cache_policy} --trace TRACE`)")
        if self.cache_policy in NEEDS_PREDICTOR:
            from moelight.expert_cache.predictors import PredictorError, Predictors

            try:
                Predictors.check_kind(Path(self.predictor).expanduser(), self.cache_policy)
            except PredictorError as e:
                raise OptionError(f"--predictor {e}") from None
        if self.prefetch_per_layer is not None and self.cache_policy_name() not in PREFETCHING:
            raise OptionError(f"--prefetch-per-layer {self.prefetch_per_layer}: --cache-policy "
                              f"{self.cache_policy_name()} never prefetches (it fetches an expert when a token needs "
                              f"it); drop the option or choose a policy that prefetches: {', '.join(PREFETCHING)}")
        unused = self.throughput_options()
        if self.mode == "latency" and unused:
            raise OptionError(f"{', '.join(unused)}: throughput mode's (CGOPipe's) options, and --mode is latency (one "
                              "batch through the expert cache: no micro-batches, pipeline schedule or policy file); "
                              "drop them or use --mode auto / throughput")
        self._check_hardware()
        if self.policy != "auto" and not Path(self.policy).expanduser().is_file():
            raise OptionError(f"--policy {self.policy}: no such file; give 'auto' or a policy JSON "
                              "from `moelight plan --save-policy`")

    def throughput_options(self) -> list[str]:
        """The throughput-mode options the job sets (latency mode runs none of them)."""
        given = {"--micro-batch-size": self.micro_batch_size is not None, "--schedule": self.schedule != "cgopipe",
                 "--policy": self.policy != "auto"}
        return [name for name, is_set in given.items() if is_set]

    def _check_hardware(self) -> None:
        from hrm.hardware_presets import list_hardware

        if self.hardware is None or self.hardware.lower() == "profile":
            return
        if self.hardware.lower() in list_hardware():
            return
        if not Path(self.hardware).expanduser().is_file():
            raise OptionError(f"--hardware {self.hardware!r} is neither a preset nor a file; valid choices: "
                              f"{', '.join(list_hardware())}, profile, or a profile JSON path")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
