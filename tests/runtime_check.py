"""What the runtime tests share: a run that records every pass's logits, its comparison with the
plain CPU engine's run of the same job (greedy tokens equal, every prefill and decode logit within
a tolerance), and the two faults each runtime test must catch (one paged expert swapped, one
micro-batch's attention output dropped)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelight.engine.generation import Engine
from moelight.runtime.executor import Executor

# float32 on the emulated device: the grouped GEMMs are the per-expert ones, attention and sums
# run in another order of the same float32 terms (differences of a few ulps)
RTOL, ATOL = 1e-4, 1e-4
# float32 on a GPU (TF32 off): cuBLAS blocks GEMMs and reduces in other orders than the CPU, and a
# near-tie in top-k routing can pick the other expert, so logits agree to ~1e-3, and a token may
# differ where the reference's two best logits are that close
GPU_RTOL, GPU_ATOL = 1e-3, 1e-3


@dataclass
class Run:
    tokens: list[list[int]]
    logits: list[tuple[str, torch.Tensor]]  # every pass in call order: ("prefill" | "decode", [B, vocab])


class Recording(Executor):
    """An executor that keeps a copy of every logit its inner executor returns."""

    def __init__(self, inner: Executor) -> None:
        self.inner, self.logits = inner, []

    def prefill(self, cache, tokens, seq_lens, offsets):
        out = self.inner.prefill(cache, tokens, seq_lens, offsets)
        self.logits.append(("prefill", out.clone()))
        return out

    def decode(self, cache, micro_batches):
        outs = self.inner.decode(cache, micro_batches)
        self.logits.append(("decode", torch.cat([o.clone() for o in outs])))
        return outs

    def release_sequence(self, offset: int) -> None:
        self.inner.release_sequence(offset)


def run_job(model, executor: Executor | None, prompts, params, batch_size: int, micro_batch_size: int,
            max_prefill_tokens: int = 4096, refill: bool = True, stats=None) -> Run:
    """The engine's run of a job on `executor` (None: the plain CPU engine), its logits recorded."""
    from moelight.runtime.plain_executor import PlainExecutor

    rec = Recording(executor or PlainExecutor(model))
    out = Engine(model, (2,), max_prefill_tokens, executor=rec, refill=refill).generate(
        prompts, params, [0] * len(prompts), batch_size, micro_batch_size, stats=stats)
    return Run([r.token_ids for r in out], rec.logits)


def assert_same_run(got: Run, ref: Run, rtol: float = RTOL, atol: float = ATOL, what: str = "") -> None:
    """Greedy tokens identical and every pass's logits within (rtol, atol) of the reference's."""
    assert got.tokens == ref.tokens, f"{what}: tokens differ from the plain engine's"
    assert [k for k, _ in got.logits] == [k for k, _ in ref.logits], f"{what}: a different sequence of passes"
    for n, ((kind, a), (_, b)) in enumerate(zip(got.logits, ref.logits, strict=True)):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, n=n, kind=kind: f"{what}: {kind} pass "
                                   f"{n}: {m}")


def assert_close_run_on_gpu(got: Run, ref: Run, rtol: float = GPU_RTOL, atol: float = GPU_ATOL,
                            what: str = "") -> None:
    """Every pass's logits within (rtol, atol) while the runs take the same tokens; a token may
    differ only where the reference's two best logits are within the tolerance (the runs diverge
    from there, so later passes are not compared)."""
    for n, ((kind, a), (_, b)) in enumerate(zip(got.logits, ref.logits, strict=False)):
        a = a.cpu()
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, n=n, kind=kind: f"{what}: {kind} "
                                   f"pass {n}: {m}")
        differ = a.argmax(-1) != b.argmax(-1)
        if bool(differ.any()):
            top2 = b[differ].topk(2, dim=-1).values
            margin = top2[:, 0] - top2[:, 1]
            assert bool((margin <= 2 * (atol + rtol * top2[:, 0].abs())).all()), (
                f"{what}: {kind} pass {n} takes another token where the reference's choice is clear "
                f"(margins {margin.tolist()})")
            return
    assert got.tokens == ref.tokens, f"{what}: tokens differ from the plain engine's"


def swap_paged_experts(pager) -> None:
    """Fault: the page table of every layer names the first two paged experts the wrong way round."""
    from moelight.models.grouped_experts import ExpertGroup, GroupedExperts

    table = pager.table

    def swapped(layer: int, slot: int) -> GroupedExperts:
        t = table(layer, slot)
        *rest, paged = t.groups
        order = torch.arange(paged.gate_up.shape[0])
        order[:2] = torch.tensor([1, 0])
        return GroupedExperts((*rest, ExpertGroup(paged.first, paged.gate_up[order], paged.down[order])),
                              t.num_experts)

    pager.table = swapped


def drop_attention(monkeypatch, micro_batch: int = 1, layer: int = 0) -> None:
    """Fault: one micro-batch's attention output of one layer never reaches the post-attention."""
    from moelight.pipeline.pass_tasks import DecodeTasks

    post = DecodeTasks.op_post_attn

    def dropped(self, j, i):
        run = post(self, j, i)
        if (j, i) != (layer, micro_batch):
            return run

        def run_without_attention():
            attn = self.held.get(("attn", j, i))
            attn[0] = torch.zeros_like(attn[0])
            run()

        return run_without_attention

    monkeypatch.setattr(DecodeTasks, "op_post_attn", dropped)
