"""Reward terms by name: the registry, the config that names terms and weights, the report that draws whatever ran,
and a training-only term that changes GRPO's reward list but not the mining/evaluation score."""

import math

import numpy as np
import pytest
import yaml
from trl import GRPOConfig, TrlParser

from emrl_data.text.scoring import ScoringConfig, score_report, total_reward, truth_from_row
from train.checks import TrainConfigError, run_cli
from train.grpo import GrpoScriptArguments, _reward_funcs, finalize_grpo_config
from train.grpo import main as grpo_main
from train.grpo_report import curve_styles, reward_curve, save_reward_curve_png, summary_lines
from train.rewards import (
    REWARD_TERMS,
    check_reward_entries,
    make_reward_funcs,
    parse_reward_entry,
    r_e,
    r_f,
    reward_term,
    reward_weights_for,
)
from train.tiny.synthetic import make_rows


EXAMPLE = "tests.train.reward_term_example.r_len"  # the module that registers r_len, named in the config


class _StubVerifier:
    """Answers every query with a fixed text."""

    def __init__(self, text):
        self.text, self.n_calls, self.n_queries = text, 0, 0

    def __call__(self, frames):
        self.n_calls, self.n_queries = self.n_calls + 1, self.n_queries + len(frames)
        return [self.text] * len(frames)

    def idle_call(self):
        return []


def _config(tmp_path, rewards):
    """grpo_tiny.yaml with `rewards` replaced; return (script args, GRPOConfig) as the CLI parses them."""
    raw = yaml.safe_load(open("train/configs/grpo_tiny.yaml"))
    raw["rewards"] = rewards
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(raw))
    parser = TrlParser((GrpoScriptArguments, GRPOConfig))
    return parser.parse_args_and_config(["--config", str(path), "--output_dir", str(tmp_path / "out")])


def _call(func, texts, rows):
    cols = {k: [r[k] for r in rows] for k in rows[0]}
    return func(
        prompts=[None] * len(texts), completions=[[{"role": "assistant", "content": t}] for t in texts], **cols
    )


def test_the_three_terms_are_registered_alike():
    assert {"r_e", "r_f", "r_c"} <= set(REWARD_TERMS)
    assert REWARD_TERMS["r_e"].source is r_e and REWARD_TERMS["r_f"].source is r_f
    funcs = make_reward_funcs(["r_e", "r_f", "r_c"], verifier=_StubVerifier(""))
    assert [f.__name__ for f in funcs] == ["r_e", "r_f", "r_c"] and funcs[:2] == [r_e, r_f]
    bound = make_reward_funcs(["r_f"], scoring_config=ScoringConfig(box_weight=0.5))[0]
    assert bound.__name__ == "r_f" and bound.keywords == {"scoring_config": ScoringConfig(box_weight=0.5)}
    with pytest.raises(ValueError, match="registered twice"):
        reward_term("r_e")(lambda completions, **kw: [0.0] * len(completions))
    with pytest.raises(ValueError, match="identifier"):
        reward_term("r e")


def test_a_term_in_its_own_module_is_one_config_line(tmp_path, processor):
    script, training = _config(tmp_path, ["r_e", "r_f", "r_c", f"{EXAMPLE}=0.05"])
    funcs = _reward_funcs(script.rewards, training, script.scoring_config(), 16)
    from tests.train.reward_term_example import r_len

    assert [f.__name__ for f in funcs] == ["r_e", "r_f", "r_c", "r_len"] and funcs[3] is r_len
    args = finalize_grpo_config(training, processor, script.rewards)
    assert args.reward_weights == [0.3, 0.5, 0.2, 0.05]  # R's terms keep ScoringConfig's weights
    assert reward_weights_for([{"r_len": 0.05}, "r_e"]) == [0.05, 0.3]  # the YAML mapping form
    # The report draws it: TRL logs `rewards/<name>/mean` per function, in the config's order.
    log = [
        {
            "step": s,
            "reward": 0.5,
            **{f"rewards/{n}/mean": 0.1 * s for n in ("r_e", "r_f", "r_c", "r_len")},
            "frac_reward_zero_std": 0.0,
            "grad_norm": 1.0,
        }
        for s in (1, 2)
    ]
    curve = reward_curve(log)
    assert list(curve) == ["reward", "rewards/r_e/mean", "rewards/r_f/mean", "rewards/r_c/mean", "rewards/r_len/mean"]
    styles = curve_styles(curve)
    assert [styles[f"rewards/{n}/mean"] for n in ("r_e", "r_f", "r_c", "r_len")] == [
        ("r_e", "C0"),
        ("r_f", "C1"),
        ("r_c", "C2"),
        ("r_len", "C3"),
    ]
    assert styles["reward"] == ("R", "black")
    assert any(line.strip().startswith("rewards/r_len/mean:") for line in summary_lines(curve, curve, log))
    assert save_reward_curve_png(curve, tmp_path / "curve.png", control=curve).stat().st_size > 0


def test_shipped_configs_name_the_three_terms_with_scoring_configs_weights(tmp_path, processor):
    for name in ("grpo.yaml", "grpo_demo.yaml", "grpo_lora.yaml", "grpo_tiny.yaml"):
        raw = yaml.safe_load(open(f"train/configs/{name}"))
        assert raw["rewards"] == ["r_e", "r_f", "r_c"], name
    script, training = _config(tmp_path, ["r_e", "r_f", "r_c"])
    weights = finalize_grpo_config(training, processor, script.rewards).reward_weights
    assert weights == list(ScoringConfig().reward_weights)


@pytest.mark.parametrize(
    ("rewards", "needle"),
    [
        (["r_e", "r_x"], "Unknown reward term 'r_x'; registered: r_c, r_e, r_f"),
        (["r_e", "r_e"], "Invalid rewards ['r_e', 'r_e']"),
        ([f"{EXAMPLE}"], "outside the score R (r_e, r_f, r_c)"),
        (["r_e=heavy"], "the weight 'heavy' is not a finite number"),
        (["no_such_pkg.r_x"], "cannot import 'no_such_pkg'"),
    ],
)
def test_a_bad_reward_entry_is_a_one_line_error_from_the_cli(rewards, needle, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        run_cli(
            grpo_main,
            ["--config", "train/configs/grpo_tiny.yaml", "--output_dir", str(tmp_path), "--rewards", *rewards],
        )
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert exc.value.code == 2 and "Traceback" not in stderr and len(errors) == 1
    assert errors[0].startswith("error: GRPO rewards: ") and needle in errors[0], errors


def test_entries_parse_as_name_and_weight():
    assert parse_reward_entry("r_e") == ("r_e", None)
    assert parse_reward_entry("r_len = 0.1") == ("r_len", 0.1)
    assert parse_reward_entry({"r_len": 0.1}) == ("r_len", 0.1)
    assert check_reward_entries(["r_e", "r_c=0.4"]) == [("r_e", None), ("r_c", 0.4)]
    with pytest.raises(ValueError, match="one term"):
        parse_reward_entry({"r_e": 1.0, "r_f": 1.0})
    with pytest.raises(TrainConfigError, match="Unknown reward term"):
        GrpoScriptArguments(rewards=["r_x"])


def test_a_training_only_term_changes_grpos_rewards_not_the_score():
    """GRPO sums its weighted terms (TRL's `nansum` over the functions); the score that mines hard cases and
    evaluates (`scoring.score_report`, R = `total_reward`) reads r_e, r_f, r_c with ScoringConfig's weights alone."""
    pos, _ = make_rows(2, n_frames=8)
    pos["frames"] = np.zeros((8, 4, 4), dtype=np.uint8)
    answer = pos["report"].split("</findings>")[0] + "</findings>"
    k = pos["key_slice_frame"]
    texts = [
        pos["report"],
        pos["report"].replace(f"<key_slice>{k}</key_slice>", f"<key_slice>{k + 2}</key_slice>"),
        "garbage",
    ]
    rows = [pos] * len(texts)

    def grpo_reward(entries):
        funcs = make_reward_funcs(entries, verifier=_StubVerifier(answer))
        values = [_call(f, texts, rows) for f in funcs]
        weights = reward_weights_for(entries)
        return [math.fsum(w * v[i] for w, v in zip(weights, values, strict=True)) for i in range(len(texts))], values

    paper, (e, f, c) = grpo_reward(["r_e", "r_f", "r_c"])
    extended, values = grpo_reward(["r_e", "r_f", "r_c", f"{EXAMPLE}=0.05"])
    assert [len(v) for v in values] == [3, 3, 3, 3] and extended != pytest.approx(paper)
    assert extended == pytest.approx([p + 0.05 * r for p, r in zip(paper, values[3], strict=True)])
    evaluation = [score_report(t, truth_from_row(pos), verifier_text=answer, n_frames=8).reward for t in texts]
    assert evaluation == pytest.approx(paper)  # the score is R, whatever GRPO's list holds
    assert evaluation == pytest.approx([total_reward(*x) for x in zip(e, f, c, strict=True)])
    mining = [score_report(t, truth_from_row(pos)).reward for t in texts]  # no verifier text: r_c None
    assert mining == pytest.approx([total_reward(x, y, None) for x, y in zip(e, f, strict=True)])
