"""Planned policies for the paper's S1 (T4) and S2 (L4) MT-Bench runs beside the artifact's.

For each generation length it prints our plan (mu, n_mb, A_g, F_g, r_w, r_c, predicted
throughput, plan time), the MoE-Lightning artifact's mu x micro-batches, and what our
HRM predicts for the artifact's (mu, n_mb) with r_w, r_c chosen by the same LP.

    python benchmarks/plan_vs_paper.py [--dtype float16] [--padded] [--markdown OUT]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hrm import WorkloadSpec, get_hardware, get_model  # noqa: E402
from optimizer import InfeasibleError, plan  # noqa: E402

# MoE-Lightning artifact, MT-Bench, Mixtral 8x7B: (mu, micro-batches) per generation length.
ARTIFACT = {
    "s2": {32: (324, 14), 64: (228, 16), 128: (164, 16), 256: (132, 12)},
    "s1": {32: (164, 19), 64: (164, 19), 128: (164, 14), 256: (100, 15)},
}
PROMPT, MAX_PROMPT = 77, 418


def rows(dtype: str, padded: bool) -> list[dict]:
    model = get_model("mixtral-8x7b")
    out = []
    for setting in ("s1", "s2"):
        hw = get_hardware(setting)
        for gen, (a_mu, a_n) in ARTIFACT[setting].items():
            wl = WorkloadSpec(PROMPT, gen, MAX_PROMPT, padded=padded)
            t0 = time.perf_counter()
            res = plan(hw, model, wl, dtype)
            dt = time.perf_counter() - t0
            try:
                theirs = plan(hw, model, wl, dtype, mu_grid=[a_mu], n_grid=[a_n], verify_with_pulp=False)
                their_thr, their_rw, their_bind = theirs.e2e_tok_s, theirs.policy.r_w, theirs.binding
            except InfeasibleError:
                their_thr, their_rw, their_bind = float("nan"), float("nan"), "does not fit"
            p = res.policy
            out.append(dict(setting=setting.upper(), gen=gen, mu=p.mu, n=p.n_mb, N=p.N, A_g=p.A_g, F_g=p.F_g,
                            r_w=p.r_w, r_c=p.r_c, thr=res.e2e_tok_s, bind=res.binding, plan_s=dt,
                            a_mu=a_mu, a_n=a_n, a_N=a_mu * a_n, a_thr=their_thr, a_rw=their_rw,
                            a_bind=their_bind))
    return out


def to_markdown(rs: list[dict]) -> str:
    head = ("| setting | gen | plan mu x n_mb (N) | A_g | F_g | r_w | r_c | pred tok/s | bound | plan s "
            "| artifact mu x n_mb (N) | HRM tok/s for artifact policy (r_w) |")
    sep = "|" + "---|" * 12
    lines = [head, sep]
    for r in rs:
        lines.append(
            f"| {r['setting']} | {r['gen']} | {r['mu']} x {r['n']} ({r['N']}) | {r['A_g']} | {r['F_g']} | "
            f"{r['r_w']:.3f} | {r['r_c']:.2f} | {r['thr']:.1f} | {r['bind']} | {r['plan_s']:.2f} | "
            f"{r['a_mu']} x {r['a_n']} ({r['a_N']}) | {r['a_thr']:.1f} ({r['a_rw']:.3f}, {r['a_bind']}) |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="float16", help="T4 has no bf16 tensor cores; the artifact runs fp16")
    ap.add_argument("--padded", action="store_true", help="pad prompts to 418 (MoE-Lightning (p))")
    ap.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = ap.parse_args()
    table = to_markdown(rows(args.dtype, args.padded))
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")


if __name__ == "__main__":
    main()
