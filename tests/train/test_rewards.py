"""Reward adapters on crafted completions return the values of docs/contract.md#scoring (None where a term does not apply)."""

import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from emrl_data.text.report import render_evidence, render_findings, render_impression, render_report
from emrl_data.text.scoring import ScoringConfig, score_report, truth_from_row
from emrl_data.types import Organ
from train.rewards import DEFAULT_REWARD_WEIGHTS, make_reward_funcs, r_e, r_f, reward_weights_for
from train.tiny.synthetic import make_rows


class _StubVerifier:
    """Answers with a fixed text per query, counts queries and keeps the frames it was shown."""

    def __init__(self, text):
        self.text, self.n_queries = text, 0
        self.n_calls = 0
        self.seen = []

    def __call__(self, frames):
        self.n_calls += 1
        self.n_queries += len(frames)
        self.seen += [np.asarray(f) for f in frames]
        return [self.text] * len(frames)

    def idle_call(self):
        return []


def _call(func, texts, rows):
    cols = {k: [r[k] for r in rows] for k in rows[0]}
    logged = {}
    out = func(
        prompts=[None] * len(texts),
        completions=[[{"role": "assistant", "content": t}] for t in texts],
        log_extra=lambda c, v: logged.setdefault(c, v),
        log_metric=lambda n, v: None,
        **cols,
    )
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


# ---------------------------------------------------------------------------------------------------------------
# One r_c: the reward TRL calls and the evaluation path (`score_report`) give the same values
# ---------------------------------------------------------------------------------------------------------------

NO_LESION = "No focal lesion is seen in the pancreas."
PANCREAS_LESION = "A 2 cm hypodense mass in the pancreatic head."
SKIP, QUERY = ScoringConfig(), ScoringConfig(negative_rows="query_named_slice")


def _frames(row_index, n=8):
    """(n, 4, 4) frames whose pixels say which row and frame they are: 50 * row_index + frame."""
    return np.stack([np.full((4, 4), 50 * row_index + f, dtype=np.uint8) for f in range(1, n + 1)])


def _seen(verifier):
    """(row, frame) of every frame the verifier was shown."""
    return [divmod(int(f[0, 0]), 50) for f in verifier.seen]


def _rows(n=2):
    rows = make_rows(n, n_frames=8)  # liver +, pancreas -, kidney +, liver -, pancreas +
    for i, row in enumerate(rows):
        row["frames"] = _frames(i)
    return rows


def _lesion_report(organ, k, location, long_mm=20.0):
    findings = render_findings(
        organ,
        has_lesion=True,
        lesion_count=1,
        long_axis_mm=long_mm,
        short_axis_mm=10.0,
        volume_mm3=1000.0,
        location=location,
        attenuation="hypo",
    )
    impression = render_impression(
        organ, has_lesion=True, lesion_count=1, long_axis_mm=long_mm, location=location, attenuation="hypo"
    )
    return render_report(findings, impression, render_evidence(k, (10, 20, 30, 40)))


def _train_and_eval(cfg, texts, rows, verifier_text, verifier=None):
    """Return r_c per completion from the training path, after asserting the evaluation path gives the same."""
    if verifier is None and cfg.cross_view != "distance_only":
        verifier = _StubVerifier(verifier_text)
    (r_c,) = make_reward_funcs(["r_c"], verifier=verifier, scoring_config=cfg)
    trained, _ = _call(r_c, texts, rows)
    evaluated = [
        score_report(
            t,
            truth_from_row(r),
            verifier_text=verifier_text,
            cfg=cfg,
            n_frames=r["n_frames"],
            truth_bbox=r.get("bbox_qwen"),
        ).r_c
        for t, r in zip(texts, rows, strict=True)
    ]
    assert trained == evaluated
    return trained


def _case(name):
    pos, neg = _rows()
    findings = pos["report"].split("</findings>")[0] + "</findings>"
    wrong_k = pos["report"].replace("<key_slice>7</key_slice>", "<key_slice>5</key_slice>")  # distance 2
    false_positive = _lesion_report(Organ.PANCREAS, 3, ("head",))
    return {
        "good report": (pos, pos["report"], findings),
        "wrong key frame": (pos, wrong_k, findings),
        "parse failure": (pos, "garbage", findings),
        "true negative": (neg, neg["report"], NO_LESION),
        "false positive, verifier sees no lesion": (neg, false_positive, NO_LESION),
        "false positive, verifier sees a lesion": (neg, false_positive, PANCREAS_LESION),
    }[name]


@pytest.mark.parametrize(
    ("name", "skip", "query", "shown"),
    [
        ("good report", 1.0, 1.0, [(0, 7)]),  # every attribute, k exact
        ("wrong key frame", 1.0 - 0.3 * 0.8, 1.0 - 0.3 * 0.8, [(0, 5)]),  # distance 2: IoU 1/5
        ("parse failure", -0.3, -0.3, []),  # -lambda: never above a parsed wrong report; no query
        ("true negative", None, 1.0, []),  # skip: r_c does not apply; query: the gold negative's own score
        ("false positive, verifier sees no lesion", None, 1.0 - 0.3, [(1, 3)]),  # the named frame is queried
        ("false positive, verifier sees a lesion", None, -0.3, [(1, 3)]),
    ],
)
def test_training_and_evaluation_r_c_are_one_function(name, skip, query, shown):
    row, text, answer = _case(name)
    for cfg, expected in ((SKIP, skip), (QUERY, query)):
        verifier = _StubVerifier(answer)
        (value,) = _train_and_eval(cfg, [text], [row], answer, verifier)
        assert value == (None if expected is None else pytest.approx(expected)), cfg
        assert _seen(verifier) == (shown if row["has_lesion"] or cfg is QUERY else [])


def test_a_parse_failure_never_outscores_a_wrong_parsed_report():
    pos, neg = _rows()
    for cfg, row, wrong in ((SKIP, pos, neg["report"]), (QUERY, neg, _lesion_report(Organ.PANCREAS, 3, ("head",)))):
        failure, parsed_wrong = _train_and_eval(cfg, ["garbage", wrong], [row, row], PANCREAS_LESION)
        assert failure == pytest.approx(-0.3) and failure <= parsed_wrong  # the lowest r_c a parsed report gets


def test_query_named_slice_shows_the_verifier_the_frame_a_false_positive_names():
    _, neg = _rows()
    texts = [neg["report"], *(_lesion_report(Organ.PANCREAS, k, ("head",)) for k in (3, 3, 5, 9)), "garbage"]
    verifier = _StubVerifier(NO_LESION)
    values = _train_and_eval(QUERY, texts, [neg] * 6, NO_LESION, verifier)
    # claims no lesion: 1; false positive the verifier rejects: 1 - lambda; k = 9 > N = 8: no query, -lambda
    assert values == pytest.approx([1.0, 0.7, 0.7, 0.7, -0.3, -0.3])
    assert _seen(verifier) == [(1, 3), (1, 5)] and verifier.n_calls == 1  # (row, 3) asked once
    confirmed = _train_and_eval(QUERY, texts[1:2], [neg], PANCREAS_LESION)
    assert confirmed == pytest.approx([-0.3])  # a lesion described on the named frame: inconsistent with the gold
    skipped = _StubVerifier(NO_LESION)
    assert _train_and_eval(SKIP, texts, [neg] * 6, NO_LESION, skipped) == [None] * 6 and skipped.n_calls == 0


def test_distance_only_is_the_window_term_alone_without_a_verifier_call():
    pos, neg = _rows()
    texts = [pos["report"].replace("<key_slice>7</key_slice>", f"<key_slice>{k}</key_slice>") for k in (7, 6, 5, 4)]
    texts += ["garbage", neg["report"]]
    for verifier in (None, _StubVerifier("ignored")):
        cfg = ScoringConfig(cross_view="distance_only")
        values = _train_and_eval(cfg, texts, [pos] * 6, "", verifier)
        assert values == pytest.approx([0.0, -0.15, -0.24, -0.3, -0.3, -0.3])  # -0.3 (1 - IoU); a miss: IoU 0
        assert verifier is None or verifier.n_calls == 0
    both = ScoringConfig(cross_view="distance_only", negative_rows="query_named_slice")
    fp = _lesion_report(Organ.PANCREAS, 3, ("head",))
    assert _train_and_eval(both, [neg["report"], fp], [neg, neg], "") == pytest.approx([0.0, -0.3])
    assert _train_and_eval(ScoringConfig(cross_view="distance_only"), [neg["report"]], [neg], "") == [None]


def test_random_frame_shows_another_rows_frame():
    rows = _rows(5)
    a, b, c = rows[0], rows[2], rows[4]  # positives: liver k=7, kidney k=4, pancreas k=2
    cfg = ScoringConfig(cross_view="random_frame")
    findings = a["report"].split("</findings>")[0] + "</findings>"
    verifier = _StubVerifier(findings)
    values = _train_and_eval(cfg, [a["report"], a["report"], b["report"]], [a, a, b], findings, verifier)
    assert _seen(verifier) == [(2, 7), (0, 4)]  # two rows: each query sees the other row's frame k
    assert values[0] == pytest.approx(1.0)  # scored as `full`: the answer against the completion's own truth
    (r_c,) = make_reward_funcs(["r_c"], verifier=_StubVerifier(findings), scoring_config=cfg)
    _, logged = _call(r_c, [a["report"], a["report"], b["report"]], [a, a, b])
    assert logged["verifier_row"] == [2, 2, 0] and logged["verifier_frame"] == [7, 7, 4]
    b = dict(b, case_id=a["case_id"])  # same case as a: a's and b's queries must show c (another case)
    draws = set()
    for seed in range(8):
        seen = []
        for _ in range(2):  # the same seed and call sequence: the same frames
            v = _StubVerifier(findings)
            (r_c,) = make_reward_funcs(["r_c"], verifier=v, scoring_config=cfg, seed=seed)
            _call(r_c, [a["report"], b["report"], c["report"]], [a, b, c])
            seen.append(_seen(v))
        assert seen[0] == seen[1]
        assert seen[0][:2] == [(4, 7), (4, 4)] and seen[0][2] in {(0, 2), (2, 2)}
        draws.add(seen[0][2])
    assert draws == {(0, 2), (2, 2)}  # c's frame comes from either other row, as the seed draws
    with pytest.raises(ValueError, match="single row"):
        _call(make_reward_funcs(["r_c"], verifier=_StubVerifier(""), scoring_config=cfg)[0], [a["report"]], [a])


# ---------------------------------------------------------------------------------------------------------------
# The GRPO script's r_c options and the one weight table
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [
        ("--negative_rows", "query", "GRPO option negative_rows='query' must be one of skip | query_named_slice."),
        (
            "--cross_view",
            "blind",
            "GRPO option cross_view='blind' must be one of full | distance_only | random_frame.",
        ),
    ],
)
def test_a_bad_r_c_option_is_a_one_line_error_from_the_cli(flag, value, needle, tmp_path, capsys):
    from train.checks import run_cli
    from train.grpo import main as grpo_main

    with pytest.raises(SystemExit) as exc:
        run_cli(grpo_main, ["--config", "train/configs/grpo_tiny.yaml", "--output_dir", str(tmp_path), flag, value])
    stderr = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in stderr
    assert [line for line in stderr.splitlines() if line.startswith("error:")] == [f"error: {needle}"]


def test_script_options_build_the_scoring_config_and_the_reward_functions(tmp_path):
    from trl import GRPOConfig

    from train.checks import TrainConfigError
    from train.grpo import GrpoScriptArguments, _reward_funcs

    script = GrpoScriptArguments(negative_rows="query_named_slice", cross_view="random_frame", box_weight=0.5)
    cfg = script.scoring_config()
    assert (cfg.negative_rows, cfg.cross_view, cfg.box_weight, cfg.reward_weights) == (
        "query_named_slice",
        "random_frame",
        0.5,
        ScoringConfig().reward_weights,
    )
    assert GrpoScriptArguments().scoring_config() == ScoringConfig()  # defaults: today's r_c

    def args(batch):
        return GRPOConfig(
            output_dir=str(tmp_path),
            num_generations=4,
            per_device_train_batch_size=batch,
            use_cpu=True,
            bf16=False,
            report_to="none",
            seed=3,
        )

    with pytest.raises(TrainConfigError, match=r"random_frame .* 4 completions = 1 prompt\(s\) .* >= 8\."):
        _reward_funcs(["r_e", "r_f", "r_c"], args(4), cfg, 16)
    *_, r_c = _reward_funcs(["r_e", "r_f", "r_c"], args(8), cfg, 16)
    assert r_c.verifier.max_new_tokens == 16 and r_c.seed == 3 and r_c.scoring_config is cfg
    (r_c,) = _reward_funcs(["r_c"], args(4), ScoringConfig(cross_view="distance_only"), 16)
    assert r_c.verifier is None  # no verifier is built: r_c makes no call at all


def _keys(node, prefix=""):
    """Yield (dotted key, value) of every key in a YAML tree."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield f"{prefix}{key}", value
            yield from _keys(value, f"{prefix}{key}.")


@pytest.mark.parametrize("path", sorted(Path("train/configs").glob("*.yaml")), ids=lambda p: p.name)
def test_no_shipped_config_restates_the_reward_weights(path):
    text = path.read_text()
    weights = ScoringConfig().reward_weights
    named = {k: v for k, v in _keys(yaml.safe_load(text)) if k.split(".")[-1] in {"reward_weights", "iou_penalty"}}
    for key, value in named.items():  # a config naming them must match ScoringConfig (none does today)
        expected = ScoringConfig().iou_penalty if key.endswith("iou_penalty") else list(weights)
        assert value == expected, (key, value)
    assert named == {}  # better: configs do not restate them at all
    numbers = r"\D+".join(re.escape(str(w)) for w in weights)
    assert re.search(numbers, text) is None, "a comment restates the weights; point to ScoringConfig instead"


def test_the_contract_states_scoring_configs_weights():
    contract = Path("docs/contract.md").read_text()
    cfg = ScoringConfig()
    assert f"`reward_weights` {cfg.reward_weights}" in contract and f"`iou_penalty` ({cfg.iou_penalty})" in contract
    assert reward_weights_for(["r_e", "r_f", "r_c"]) == list(cfg.reward_weights)
