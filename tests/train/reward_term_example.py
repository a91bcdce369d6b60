"""A training-only reward term in a module of its own: what adding a term takes (tests/train/test_reward_terms.py)."""

from train.rewards import completion_text, reward_term


@reward_term("r_len")
def r_len(completions, **columns):
    """The completion's length in characters over 400, capped at 1 (TRL's convention: the rows' columns ignored)."""
    return [min(1.0, len(completion_text(c)) / 400) for c in completions]
