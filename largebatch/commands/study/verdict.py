"""The verdict rule of every claim of every study kind, one rule with its parameters in the claim (`protocol.Rule`,
from the study's protocol).

1. A claim reads its row (its group's chosen lr, mean over seeds) and the row it is measured against: another
   group (`against`), or the kind's baseline, the baseline optimizer at the smallest batch that ran (a claim at
   that batch is not judged). A claim whose rows did not both run has no verdict.
2. difference = its top-1 - the other's, in points / 100; spread = the larger of the two rows' sample standard
   deviations over seeds.
3. It holds where `difference OP points / 100 (+ spread where beyond_spread)` (`holds`), and so does every `also`
   rule on its own row: its top-1 against another of its figures (the ensemble against its best snapshot).
"""
from __future__ import annotations

from typing import Any

from largebatch.commands.study.protocol import Claim, Rule

OPS = {">=": lambda d, bound: d >= bound, ">": lambda d, bound: d > bound, "<": lambda d, bound: d < bound}


def holds(difference: float, spread: float, rule: Rule) -> bool:
    """Step 3: the one verdict rule."""
    return OPS[rule.op](difference, rule.points / 100 + (spread if rule.beyond_spread else 0.0))


def _against(claim: Claim, row: dict, rows: dict[tuple, dict], kind) -> dict | None:
    """Step 1: the row `claim` is measured against."""
    if claim.against is not None:
        return rows.get(tuple(claim.against[a] for a in kind.axes))
    base = sorted((r for r in rows.values() if all(r.get(k) == v for k, v in kind.protocol.baseline.items())),
                  key=lambda r: r["batch"])
    return base[0] if base and base[0]["batch"] != row["batch"] else None


def judge(kind, table: dict) -> list[dict]:
    """The verdict of each of the kind's claims whose rows ran, on `table`'s chosen rows (`summary.summarise`):
    listed claims (batch-scaling) with the rows' figures, who claimed it and `held`; a variant kind's with the
    difference, spread, `holds` and its `also` differences."""
    rows = {tuple(r[a] for a in kind.axes): r for key, r in table.items() if key != "verdict" and r.get("chosen", True)}
    out: list[dict[str, Any]] = []
    for claim in kind.protocol.claims:
        row = rows.get(tuple(claim.cell[a] for a in kind.axes))
        ref = _against(claim, row, rows, kind) if row is not None else None
        if row is None or ref is None:
            continue
        difference = row["top1_mean"] - ref["top1_mean"]                       # step 2
        spread = max(row["top1_std"], ref["top1_std"])
        also = {a.name: row["top1_mean"] - row[f"{a.figure}_mean"] for a in claim.also}
        held = holds(difference, spread, claim.rule) and all(holds(also[a.name], 0.0, a.rule) for a in claim.also)
        if kind.claims_listed:
            out.append({"who": claim.who, "claim": claim.claim, **{a: row[a] for a in kind.axes},
                        "top1": row["top1_mean"], "baseline_top1": ref["top1_mean"], "baseline_batch": ref["batch"],
                        "difference": difference, "spread": spread, "seeds": min(row["seeds"], ref["seeds"]),
                        "held": held})
        else:
            out.append({"difference": difference, "spread": spread, "holds": held, **also})
    return out
