"""Hard-case selection for GRPO (SPEC §1.3, the paper's rule): which SFT train rows the SFT model gets wrong.

A row is hard when the SFT model's report has the wrong existence, any wrong attribute (size, location,
enhancement) or misses the key slice (K-Hit) — `emrl_data.scoring.is_hard`, so "hard" is by construction "low reward
under the GRPO reward". Hard rows are ranked by R ascending (hardest first; ties by case id) and the set is
stratified by organ: each organ gets a share of `target_size` proportional to its number of hard rows (largest
remainder), so the hard set keeps the organ mix of the mistakes instead of being filled by the worst organ alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from emrl_data.scoring import ReportScore, is_hard
from emrl_data.types import Organ


@dataclass(frozen=True, slots=True)
class HardRow:
    """A selected row: its key, why it was chosen, its rank within its organ (1 = hardest) and its reward."""

    case_id: str
    organ: str
    reasons: tuple[str, ...]
    rank: int
    reward: float


def organ_quotas(hard_counts: Mapping[str, int], target_size: int) -> dict[str, int]:
    """Split `target_size` across organs in proportion to their hard rows (largest remainder, ties by organ order).

    >>> organ_quotas({"liver": 30, "pancreas": 10, "kidney": 0}, 8)
    {'liver': 6, 'pancreas': 2, 'kidney': 0}
    """
    if target_size < 0:
        raise ValueError(f"target_size={target_size} must be >= 0.")
    total = sum(hard_counts.values())
    if total <= target_size:
        return dict(hard_counts)
    exact = {organ: target_size * n / total for organ, n in hard_counts.items()}
    quotas = {organ: int(v) for organ, v in exact.items()}
    order = [str(o) for o in Organ]
    leftovers = sorted(hard_counts, key=lambda o: (-(exact[o] - quotas[o]), order.index(o) if o in order else 99))
    for organ in leftovers[: target_size - sum(quotas.values())]:
        quotas[organ] += 1
    return quotas


def select_hard_rows(
    candidates: Sequence[tuple[Mapping[str, Any], ReportScore]], *, target_size: int = 2000
) -> list[HardRow]:
    """Select at most `target_size` hard rows, stratified by organ, hardest (lowest R) first within each organ.

    Args:
        candidates: (row, score) pairs; a row needs `case_id` and `organ`.
        target_size: the cap (the paper's hard set has about 2K rows).

    Returns:
        The chosen rows in (organ, rank) order.
    """
    by_organ: dict[str, list[tuple[float, str, tuple[str, ...]]]] = {}
    for row, score in candidates:
        hard, reasons = is_hard(score)
        if hard:
            by_organ.setdefault(str(row["organ"]), []).append((score.reward, str(row["case_id"]), reasons))
    quotas = organ_quotas({o: len(v) for o, v in by_organ.items()}, target_size)
    chosen: list[HardRow] = []
    for organ in sorted(by_organ, key=lambda o: [str(x) for x in Organ].index(o)):
        ranked = sorted(by_organ[organ])
        for rank, (reward, case_id, reasons) in enumerate(ranked[: quotas[organ]], start=1):
            chosen.append(HardRow(case_id, organ, reasons, rank, reward))
    return chosen
