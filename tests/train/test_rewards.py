"""Reward adapters on crafted completions return the SPEC §7 values (None where a term does not apply)."""

import pytest


pytest.importorskip("emrl_data.scoring")

from train.rewards import make_reward_funcs, reward_weights_for  # noqa: E402
from train.synthetic import make_rows  # noqa: E402


class _StubVerifier:
    """Answers with a fixed text per query and counts queries."""

    def __init__(self, text):
        self.text, self.n_queries = text, 0

    def __call__(self, frames):
        self.n_queries += len(frames)
        return [self.text] * len(frames)


def _call(func, texts, rows):
    cols = {k: [r[k] for r in rows] for k in rows[0]}
    logged = {}
    out = func(prompts=[None] * len(texts), completions=[[{"role": "assistant", "content": t}] for t in texts],
               log_extra=lambda c, v: logged.setdefault(c, v), log_metric=lambda n, v: None, **cols)  # fmt: skip
    return out, logged


def test_rewards_on_crafted_completions():
    rows = make_rows(2, n_frames=8)  # row 0 positive (liver), row 1 negative (pancreas)
    pos, neg = rows
    findings = pos["report"].split("</findings>")[0] + "</findings>"
    verifier = _StubVerifier(findings)
    r_e, r_f, r_c = make_reward_funcs(["r_e", "r_f", "r_c"], verifier=verifier)
    texts = [pos["report"], neg["report"], "garbage", neg["report"]]
    truth = [pos, neg, pos, pos]
    e, logged = _call(r_e, texts, truth)
    assert e == [1.0, 1.0, 0.0, 0.0]  # exact, true negative, parse failure, missed lesion
    assert logged["parse_failure"][0] == "" and logged["parse_failure"][2] != ""
    f, _ = _call(r_f, texts, truth)
    assert f[0] == pytest.approx(1.0) and f[1] == 1.0 and f[2] == 0.0 and f[3] == 0.0
    c, logged = _call(r_c, texts, truth)
    assert verifier.n_queries == 4  # once per completion
    assert c[0] == pytest.approx(1.0)  # verifier text carries every attribute, k exact -> no window penalty
    assert c[1] is None  # true negative: r_c does not apply
    assert logged["verifier"][0] == findings and logged["verifier"][2] == ""


@pytest.mark.parametrize(
    ("names", "weights"),
    [
        (["r_e"], [0.3]),  # ablation 1
        (["r_e", "r_f"], [0.3, 0.5]),  # ablation 2
        (["r_e", "r_f", "r_c"], [0.3, 0.5, 0.2]),  # full E-MRL
    ],
)
def test_reward_weights(names, weights):
    assert reward_weights_for(names) == weights


def test_unknown_reward_name_raises():
    with pytest.raises(ValueError, match="r_e"):
        make_reward_funcs(["r_x"])
    with pytest.raises(ValueError, match="Verifier"):
        make_reward_funcs(["r_c"])
