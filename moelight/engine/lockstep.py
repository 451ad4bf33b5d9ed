"""Rank 0's engine under tensor parallelism: every call goes to the followers first.

The followers run the same `Engine.generate` on the same prompts, parameters and seeds, so
batching, micro-batching and sampling decide the same way on every rank without further
messages; the layers' all-reduces keep the hidden states (and so the tokens) identical.
Only rank 0 passes `on_finish`, so only it writes results and moves the progress bar.
"""

from __future__ import annotations

from moelight.engine.generation import Engine, GenerationStats, SequenceResult
from moelight.parallel.rank_group import RankGroup


class LockstepEngine:
    def __init__(self, engine: Engine, group: RankGroup) -> None:
        self.engine, self.group = engine, group
        self.model = engine.model

    def generate(self, prompts, params, seeds, batch_size: int, micro_batch_size: int, on_finish=None,
                 stats: GenerationStats | None = None) -> list[SequenceResult]:
        try:
            self.group.send("generate", prompts, params, seeds, batch_size, micro_batch_size)
            return self.engine.generate(prompts, params, seeds, batch_size, micro_batch_size,
                                        on_finish=on_finish, stats=stats)
        except Exception as e:
            error = self.group.failure(e)
            if error is e:
                raise
            raise error from e
        except BaseException:  # Ctrl-C: the followers may be mid-collective; they are ended, not stopped
            self.group.failed = True
            raise
