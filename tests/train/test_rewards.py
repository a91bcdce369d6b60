"""Reward adapters on crafted completions return the values of docs/contract.md#scoring (None where a term does not apply)."""

import pytest

from emrl_data.text.scoring import ScoringConfig
from train.rewards import DEFAULT_REWARD_WEIGHTS, make_reward_funcs, r_e, r_f, reward_weights_for
from train.tooling.synthetic import make_rows


class _StubVerifier:
    """Answers with a fixed text per query and counts queries."""

    def __init__(self, text):
        self.text, self.n_queries = text, 0

        self.n_calls = 0

    def __call__(self, frames):
        self.n_calls += 1
        self.n_queries += len(frames)
        return [self.text] * len(frames)

    def idle_call(self):
        return []


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
    assert verifier.n_queries == 1  # only the positive row with a usable key frame is verified
    assert c[0] == pytest.approx(1.0)  # verifier text carries every attribute, k exact -> no window penalty
    assert c[1] is None  # true negative: r_c does not apply
    assert logged["verifier"][0] == findings and logged["verifier"][2] == ""
    assert c[2] == pytest.approx(-0.3) and c[3] == pytest.approx(-0.3)  # no usable k: -lambda, no query


def test_r_c_dedupes_identical_row_k_queries_and_skips_true_negatives():
    pos, neg = make_rows(2, n_frames=8)
    verifier = _StubVerifier(pos["report"].split("</findings>")[0] + "</findings>")
    (r_c,) = make_reward_funcs(["r_c"], verifier=verifier)
    k = pos["key_slice_frame"]
    shifted = pos["report"].replace(f"<key_slice>{k}</key_slice>", f"<key_slice>{k + 1}</key_slice>")
    c, _ = _call(r_c, [pos["report"], pos["report"], shifted, pos["report"]], [pos] * 4)
    assert verifier.n_calls == 1 and verifier.n_queries == 2  # (row, k) and (row, k + 1)
    assert c == pytest.approx([1.0, 1.0, 0.85, 1.0])  # distance 1: IoU 2/4 -> 1 - 0.3 * 0.5
    c, _ = _call(r_c, [neg["report"]] * 4, [neg] * 4)
    assert c == [None] * 4 and verifier.n_calls == 1  # true negatives: no verifier call at all


def test_box_term_is_off_by_default_and_adds_iou_when_on():
    (pos,) = make_rows(1, n_frames=8)
    verifier = _StubVerifier(pos["report"].split("</findings>")[0] + "</findings>")
    (plain,) = make_reward_funcs(["r_c"], verifier=verifier)
    (boxed,) = make_reward_funcs(["r_c"], verifier=verifier, scoring_config=ScoringConfig(box_weight=0.5))
    assert _call(plain, [pos["report"]], [pos])[0] == pytest.approx([1.0])
    assert _call(boxed, [pos["report"]], [pos])[0] == pytest.approx([1.5])  # the report's box is the truth box


def test_reward_functions_are_plain_functions_keyed_by_name():
    funcs = make_reward_funcs(["r_e", "r_f"])
    assert funcs == [r_e, r_f] and [f.__name__ for f in funcs] == ["r_e", "r_f"]


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


def test_weights_come_from_scoring_config_and_a_wrong_length_raises():
    assert DEFAULT_REWARD_WEIGHTS == ScoringConfig().reward_weight_table() == {"r_e": 0.3, "r_f": 0.5, "r_c": 0.2}
    assert reward_weights_for(["r_e", "r_c"], scoring_config=ScoringConfig(reward_weights=(1, 2, 3))) == [1.0, 3.0]
    with pytest.raises(ValueError, match="one weight per reward"):
        reward_weights_for(["r_e", "r_f", "r_c"], [0.3, 0.5])
    with pytest.raises(ValueError, match="3 weights"):
        ScoringConfig(reward_weights=(0.3, 0.5))


def test_unknown_reward_name_raises():
    with pytest.raises(ValueError, match="r_e"):
        make_reward_funcs(["r_x"])
    with pytest.raises(ValueError, match="Verifier"):
        make_reward_funcs(["r_c"])
