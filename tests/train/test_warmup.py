"""The criterion warm-up, the verifier task, the visible-lesion rows and the miniature's guards (fast, exact)."""

import json
import re

import numpy as np
import pytest

from emrl_data.organs import side_locations
from emrl_data.text.parser import parse_free_text
from emrl_data.text.report import NEGATIVE_FINDINGS, render_prompt
from emrl_data.types import Organ
from model_io.video import frames_to_array
from train.checks import TrainConfigError
from train.miniature.config import MiniatureConfig, load_config
from train.miniature.run_report import claim_check
from train.miniature.study import MINIATURE_WARMUP_KEYS, Miniature, check_split
from train.tiny.model import build_model, build_processor
from train.tiny.synthetic import VISIBLE_INTENSITY, make_visible_rows
from train.tiny.verifier_data import BalancedPairs, FrameTarget, VerifierCollator, frame_targets, verifier_examples
from train.tiny.warmup import balanced_rows, held_out_indices, lm_warmup
from train.tiny.warmup_checks import (
    _blind_partner,
    _eval_frames,
    format_verifier,
    reports_claim_both_classes,
    score_verifier,
    verifier_gaps,
)


def test_held_out_indices_span_the_table():
    assert held_out_indices(56, 8) == [3, 10, 17, 24, 31, 38, 45, 52]
    assert held_out_indices(3, 3) == [0, 1, 2]


def test_visible_rows_show_the_lesion_only_in_the_pixels():
    rows = make_visible_rows(12, n_frames=6, size_px=64, seed=3, organs=("kidney",))
    assert {r["prompt"] for r in rows} == {render_prompt(Organ.KIDNEY, 6)}  # the prompt gives nothing away
    assert {r["has_lesion"] for r in rows} == {True, False}
    for row in rows:
        frames = frames_to_array(row["frames"])
        if not row["has_lesion"]:
            assert frames.max() < 200 and row["key_slice_frame"] is None
            continue
        k, (x1, y1, x2, y2) = row["key_slice_frame"], (v * 64 // 1000 for v in row["bbox_qwen"])
        center = frames[k - 1, (y1 + y2) // 2, (x1 + x2) // 2]
        assert center == VISIBLE_INTENSITY[row["attenuation"]]  # drawn exactly (the noise is under the disc)
        side = 0 if (x1 + x2) / 2 < 32 else 1
        assert row["location"] == [["left"], ["right"]][side]
        assert row["long_axis_mm"] in (12.0, 31.0, 48.0)


def test_frame_targets_agree_with_the_drawn_mask_on_every_frame():
    masks: list = []
    rows = make_visible_rows(24, n_frames=8, size_px=64, seed=5, organs=("kidney", "liver"), span=3, masks_out=masks)
    assert len(masks) == 24 and {r["has_lesion"] for r in rows} == {True, False}
    n_present = 0
    for row, mask in zip(rows, masks, strict=True):
        targets = frame_targets(row, lesion_span=3)
        frames = frames_to_array(row["frames"])
        assert [t.frame for t in targets] == list(range(8))
        for t in targets:
            shows = bool(mask[t.frame].any())
            assert t.present == shows  # never labelled against its pixels
            if not shows:
                assert t.answer == NEGATIVE_FINDINGS[Organ(row["organ"])] and t.location is None
                continue
            n_present += 1
            assert (frames[t.frame][mask[t.frame]] == VISIBLE_INTENSITY[row["attenuation"]]).all()
            parsed = parse_free_text(t.answer, row["organ"])
            assert parsed.has_lesion and parsed.attenuation == t.attenuation == row["attenuation"]
            xs = np.nonzero(mask[t.frame])[1]
            side = 0 if xs.mean() < 32 else 1
            assert set(parsed.location) == set(side_locations(row["organ"])[side]) == set(t.location)
            assert round(t.long_axis_mm / 10, 1) == parsed.long_axis_cm  # the long axis the answer writes
            assert t.distance == abs(t.frame + 1 - row["key_slice_frame"])
            key_radius = (mask[row["key_slice_frame"] - 1].any(axis=0).sum() + 1) // 2  # a disc of radius r spans 2r-1
            radius = (mask[t.frame].any(axis=0).sum() + 1) // 2
            assert parsed.long_axis_cm == pytest.approx(
                round(row["long_axis_mm"] * radius / key_radius, 1) / 10, abs=0.051
            )
        if row["has_lesion"]:  # span 3: the key frame and up to 3 each side (frames 1-2 away included)
            k = row["key_slice_frame"]
            assert [t.frame + 1 for t in targets if t.present] == [f for f in range(1, 9) if abs(f - k) <= 3]
    assert n_present > 40


def test_balanced_pairs_draw_half_with_a_lesion():
    rows = make_visible_rows(8, n_frames=8, size_px=32, seed=2, organs=("kidney",), span=3)
    pairs = BalancedPairs(rows, np.random.default_rng(0), lesion_span=3)
    negative = NEGATIVE_FINDINGS[Organ.KIDNEY]
    n_positive = sum(r["has_lesion"] for r in rows)
    assert len(pairs) == 8 * 8 and len(pairs.present) == sum(
        len(frame_targets(r, 3)) - sum(not t.present for t in frame_targets(r, 3)) for r in rows
    )
    assert n_positive > 0 and all(answer != negative for _, answer in pairs.present)
    drawn = pairs.draw(6)
    assert [answer == negative for _, answer in drawn] == [False] * 3 + [True] * 3


def test_legacy_verifier_examples_without_a_span_and_labels_cover_the_answer_only():
    rows = make_visible_rows(6, n_frames=8, size_px=64, seed=0, organs=("kidney",))
    positive = next(r for r in rows if r["has_lesion"])
    pairs = verifier_examples(positive, np.random.default_rng(0))
    frames = frames_to_array(positive["frames"])
    assert (pairs[0][0] == frames[positive["key_slice_frame"] - 1]).all()
    assert pairs[0][1] == positive["report"].split("<findings>")[1].split("</findings>")[0]
    if len(pairs) > 1:  # a frame at least 3 away from the key frame, described as lesion-free
        assert pairs[1][1] == NEGATIVE_FINDINGS[Organ.KIDNEY]
        assert any(
            (pairs[1][0] == f).all() and abs(i + 1 - positive["key_slice_frame"]) >= 3 for i, f in enumerate(frames)
        )
    spanned = verifier_examples(positive, np.random.default_rng(0), lesion_span=1)
    assert [a for _, a in spanned] == [t.answer for t in frame_targets(positive, 1)]
    processor = build_processor()
    batch = VerifierCollator(processor)(pairs)
    for i, (_, answer) in enumerate(pairs):
        labelled = batch["labels"][i][batch["labels"][i] != -100]
        assert processor.tokenizer.decode(labelled) == answer + "<|im_end|>"


def test_score_verifier_rates_and_gates():
    hypo_left = FrameTarget(0, "x", True, ("left",), "hypo")
    clear = FrameTarget(1, "y", False)
    asked = [("kidney", hypo_left)] * 4 + [("kidney", clear)] * 2
    texts = [
        "A hypodense lesion in the left kidney measures 3.1 x 2.2 cm.",  # all right
        "A hyperdense lesion in the left kidney measures 3.1 x 2.2 cm.",  # attenuation wrong
        "A hypodense lesion in the right kidney measures 3.1 x 2.2 cm.",  # location wrong
        "No focal renal lesion.",  # missed
        "No focal renal lesion.",
        "",
    ]  # right; unreadable = wrong
    acc = score_verifier(asked, texts)
    assert acc == {
        "sensitivity": 0.75,
        "specificity": 0.5,
        "location": 0.5,
        "attenuation": 0.5,
        "size": 0.0,
        "n_lesion_frames": 4,
        "n_clear_frames": 2,
        "n_key_frames": 0,
    }
    assert verifier_gaps(acc, 0.6) == ["specificity 50% < 60%", "location 50% < 60%", "attenuation 50% < 60%"]
    assert verifier_gaps(acc, 0.0) == []
    assert format_verifier(acc) == "sens 75%, spec 50%, location 50%, attenuation 50%, size 0% (4 + 2 frames)"


def test_warmup_that_misses_its_verifier_gates_fails_in_one_line():
    rows = make_visible_rows(4, n_frames=4, size_px=32, seed=0, organs=("kidney",), span=1)
    processor = build_processor()
    model = build_model(processor.tokenizer, seed=0)
    lines: list[str] = []
    with pytest.raises(TrainConfigError) as err:
        lm_warmup(
            model,
            processor,
            rows[:3],
            rows[3:],
            max_steps=2,
            learning_rate=1e-3,
            batch_size=1,
            verifier_batch_size=2,
            eval_every=2,
            target_parse_rate=0.0,
            max_new_tokens=4,
            lesion_span=1,
            target_verifier_accuracy=0.9,
            verifier_eval_frames=4,
            verifier_max_new_tokens=4,
            log=lines.append,
            keys=MINIATURE_WARMUP_KEYS,
        )
    message = str(err.value)
    assert "\n" not in message and "verifier accuracy below its gates" in message
    assert "after the step cap warmup_max_steps=2; raise warmup_max_steps, or" in message
    assert "lm_warmup" not in message
    assert len(lines) == 1 and ", verifier sens " in lines[0]


def test_warmup_that_misses_its_criterion_fails_in_one_line():
    rows = make_visible_rows(4, n_frames=4, size_px=32, seed=0, organs=("kidney",))
    processor = build_processor()
    model = build_model(processor.tokenizer, seed=0)
    with pytest.raises(TrainConfigError) as err:
        lm_warmup(
            model,
            processor,
            rows[:3],
            rows[3:],
            max_steps=2,
            learning_rate=1e-3,
            batch_size=1,
            verifier_batch_size=1,
            eval_every=2,
            target_parse_rate=1.0,
            max_new_tokens=4,
            log=lambda _: None,
        )
    message = str(err.value)
    assert "\n" not in message and "lm_warmup_steps=2" in message and "below its target" in message


def test_warmup_plan_errors_name_the_callers_keys():
    rows = make_visible_rows(2, n_frames=4, size_px=32, seed=0, organs=("kidney",))
    for keys, expected in (
        (None, "lm_warmup_eval_every=5 must be in 1..lm_warmup_steps (2)."),
        (MINIATURE_WARMUP_KEYS, "warmup_eval_every=5 must be in 1..warmup_max_steps (2)."),
    ):
        with pytest.raises(TrainConfigError) as err:
            lm_warmup(
                None,
                None,
                rows[:1],
                rows[1:],
                max_steps=2,
                learning_rate=1e-3,
                eval_every=5,
                **({} if keys is None else {"keys": keys}),
            )
        assert str(err.value) == expected


def test_miniature_refuses_a_test_split_too_small_for_its_intervals():
    cfg = MiniatureConfig(n_test=12, organs=["kidney"], min_test_rows_per_class=10)
    rows = make_visible_rows(12, n_frames=4, size_px=32, seed=1, organs=("kidney",))
    with pytest.raises(TrainConfigError) as err:
        check_split(rows, cfg)
    assert "\n" not in str(err.value) and "raise n_test (now 12)" in str(err.value)


def test_miniature_config_rejects_unknown_keys(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("n_train: 10\nn_tset: 5\n")
    with pytest.raises(TrainConfigError, match=r"unknown keys \['n_tset'\]"):
        load_config(path)
    path.write_text("n_train: 10\n")
    cfg = load_config(path, {"grpo_learning_rate": "1e-4", "sft_steps": "7"})  # as `--set` reads them
    assert (cfg.n_train, cfg.grpo_learning_rate, cfg.sft_steps) == (10, 1e-4, 7)
    with pytest.raises(TrainConfigError, match=r"sft_steps='many': expected a number \(int\)"):
        load_config(None, {"sft_steps": "many"})


def test_miniature_resumes_finished_stages_and_refuses_another_config(tmp_path):
    cfg = MiniatureConfig(n_train=6, n_test=8, n_frames=4, size_px=32, organs=["kidney"], min_test_rows_per_class=1)
    lines: list[str] = []
    Miniature(cfg, tmp_path, log=lines.append).run(("data",))
    first = json.loads((tmp_path / "data" / "done.json").read_text())
    assert first["n_train"] == 6 and first["n_test"] == 8
    Miniature(cfg, tmp_path, log=lines.append).run(("data",))
    assert lines[-1].startswith("== data: done earlier")
    other = MiniatureConfig(n_train=7, n_test=8, n_frames=4, size_px=32, organs=["kidney"], min_test_rows_per_class=1)
    with pytest.raises(TrainConfigError, match="another configuration"):
        Miniature(other, tmp_path, log=lines.append).run(("data",))


def test_miniature_reuses_data_warmup_and_sft_of_a_run_that_differs_only_in_grpo(tmp_path):
    small = {
        "n_train": 6,
        "n_test": 8,
        "n_frames": 4,
        "size_px": 32,
        "organs": ["kidney"],
        "min_test_rows_per_class": 1,
    }
    source, lines = tmp_path / "source", []
    Miniature(MiniatureConfig(**small), source, log=lines.append).run(("data",))
    variant = MiniatureConfig(**small, num_generations=8, grpo_learning_rate=1e-4, beta=0.04)
    with pytest.raises(TrainConfigError, match="stage warmup has not finished there; run it first"):
        Miniature(variant, tmp_path / "early", log=lines.append).reuse(source)
    for stage, record in (("warmup", {"steps": 3}), ("sft", {"steps": 5})):  # stand-ins: reuse copies, never reads
        (source / stage).mkdir()
        (source / stage / "model.safetensors").write_bytes(b"weights of " + stage.encode())
        (source / stage / "done.json").write_text(json.dumps(record))
    target = tmp_path / "variant"
    assert Miniature(variant, target, log=lines.append).reuse(source) == ["data", "warmup", "sft"]
    assert (target / "sft" / "model.safetensors").read_bytes() == b"weights of sft"
    assert json.loads((target / "warmup" / "done.json").read_text()) == {"steps": 3}
    assert (target / "data" / "done.json").read_text() == (source / "data" / "done.json").read_text()
    assert json.loads((target / "config.json").read_text())["num_generations"] == 8
    assert Miniature(variant, target, log=lines.append).reuse(source) == []  # already there: nothing copied
    Miniature(variant, target, log=lines.append).run(("data", "warmup", "sft"))
    assert [re.sub(r"\(\d+ s\)", "(N s)", line) for line in lines[-3:]] == [
        f"== {s}: done earlier (N s), skipped" for s in ("data", "warmup", "sft")
    ]  # the data stage's own seconds, whatever the machine's load
    other_data = MiniatureConfig(**small | {"n_train": 7})
    with pytest.raises(TrainConfigError, match=r"differs on \['n_train'\], which the data"):
        Miniature(other_data, tmp_path / "other", log=lines.append).reuse(source)
    assert not (tmp_path / "other").exists()


def test_claim_check_compares_gaps_with_interval_half_widths():
    def model(bacc, khit):
        return {
            "average_bacc": {"value": bacc, "ci_low": bacc - 0.05, "ci_high": bacc + 0.05},
            "k_hit": {"value": khit, "ci_low": khit - 0.1, "ci_high": khit + 0.1},
        }

    results = {
        "sft": model(0.6, 0.3),
        "grpo_a": model(0.7, 0.35),
        "grpo_b": model(0.68, 0.2),
        "grpo_c": model(0.6, 0.3),
    }
    claim = claim_check(results)
    assert claim["average_bacc: (a) - sft"]["beyond_interval"] is True  # +0.10 > 0.05
    assert claim["k_hit: (a) - sft"]["beyond_interval"] is False  # +0.05 < 0.10
    assert claim["k_hit: (a) - grpo_b"]["beyond_interval"] is True  # +0.15 > 0.10
    assert claim["claim_holds"] is True


@pytest.mark.slow
def test_sft_cli_warmup_cap_is_a_one_line_error(sft_table, tmp_path, capsys):
    from train.checks import run_cli
    from train.tiny.demo_sft import main as sft_main

    argv = [
        "--config",
        "train/configs/sft_demo.yaml",
        "--dataset_dir",
        str(sft_table),
        "--output_dir",
        str(tmp_path / "sft"),
        "--lm_warmup_steps",
        "2",
        "--lm_warmup_target_parse_rate",
        "0.95",
        "--lm_warmup_eval_every",
        "2",
        "--lm_warmup_val_rows",
        "2",
        "--gradient_checkpointing",
        "false",
    ]
    with pytest.raises(SystemExit) as exit_info:
        run_cli(sft_main, argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: LM warm-up: held-out parse rate ") and "lm_warmup_steps=2" in err[-1]
    assert not (tmp_path / "sft" / "model.safetensors").exists()  # nothing half-written


def test_balanced_rows_draw_half_positive():
    rows = make_visible_rows(10, n_frames=4, size_px=32, seed=4, organs=("kidney",), positive_fraction=0.2)
    assert 0 < sum(r["has_lesion"] for r in rows) < 5  # a minority of positives
    drawn = balanced_rows(rows, np.random.default_rng(0), 6)
    assert [r["has_lesion"] for r in drawn] == [True] * 3 + [False] * 3
    only_negative = [r for r in rows if not r["has_lesion"]]
    assert not any(r["has_lesion"] for r in balanced_rows(only_negative, np.random.default_rng(0), 4))


@pytest.mark.slow
@pytest.mark.parametrize("cap_is_error", [True, False])
def test_demo_sft_that_misses_both_classes_within_its_rounds_fails_or_notes_in_one_line(
    sft_table, tmp_path, capsys, cap_is_error
):
    from train.checks import run_cli
    from train.tiny.demo_sft import main as sft_main

    # No warm-up: the random tiny model writes nothing parse_report reads, so sensitivity is 0 after each round.
    argv = [
        "--config",
        "train/configs/sft_demo.yaml",
        "--dataset_dir",
        str(sft_table),
        "--output_dir",
        str(tmp_path / "sft"),
        "--lm_warmup_steps",
        "0",
        "--max_steps",
        "1",
        "--sft_max_rounds",
        "2",
        "--sft_stop_split",
        "test",
        "--parse_rate_split",
        "test",
        "--sft_cap_is_error",
        str(cap_is_error),
    ]
    missed = (
        "demo SFT: the test split's existence sensitivity 0%, specificity 0% after sft_max_rounds=2 rounds of 1 steps"
    )
    if cap_is_error:
        with pytest.raises(SystemExit) as exit_info:
            run_cli(sft_main, argv)
        assert exit_info.value.code == 2
    else:
        run_cli(sft_main, argv)  # the demo's setting: a note, and the last round's model is saved
    captured = capsys.readouterr()
    assert [line for line in captured.out.splitlines() if line.startswith("SFT round")] == [
        "SFT round 1 (1 steps): test split sensitivity 0%, specificity 0%",
        "SFT round 2 (2 steps): test split sensitivity 0%, specificity 0%",
    ]
    if cap_is_error:
        assert captured.err.strip().splitlines()[-1] == f"error: {missed} (both must be above 0); raise sft_max_rounds"
        assert "note:" not in captured.out
    else:
        assert f"note: {missed}: the model answers one class there" in captured.out
        assert (tmp_path / "sft" / "model.safetensors").exists()


def test_reports_claim_both_classes_needs_a_right_claim_of_each_kind():
    rows = [{"organ": "kidney", "has_lesion": True}, {"organ": "kidney", "has_lesion": False}]
    positive = "<findings>A hypodense lesion in the left kidney measures 3.1 x 2.2 cm.</findings>"
    negative = f"<findings>{NEGATIVE_FINDINGS[Organ.KIDNEY]}</findings>"
    assert reports_claim_both_classes(rows, [positive, negative]) is True
    assert reports_claim_both_classes(rows, [negative, negative]) is False  # "no lesion" everywhere
    assert reports_claim_both_classes(rows, [positive, positive]) is False  # "lesion" everywhere
    assert reports_claim_both_classes(rows, [negative, positive]) is False  # both wrong


def test_warmup_that_never_claims_both_classes_fails_in_one_line():
    rows = make_visible_rows(6, n_frames=4, size_px=32, seed=0, organs=("kidney",))
    processor = build_processor()
    model = build_model(processor.tokenizer, seed=0)
    with pytest.raises(TrainConfigError) as err:
        lm_warmup(
            model,
            processor,
            rows[:4],
            rows[4:],
            max_steps=2,
            learning_rate=1e-3,
            batch_size=1,
            verifier_batch_size=1,
            eval_every=2,
            target_parse_rate=0.0,
            max_new_tokens=4,
            require_both_classes=True,
            log=lambda _: None,
        )
    message = str(err.value)
    assert "\n" not in message and "never claimed a lesion on a positive row" in message


@pytest.mark.parametrize(("target_parse_rate", "class_rows_generated"), [(0.0, 1), (2.0, 0)])
def test_warmup_reads_both_classes_on_its_class_rows_once_the_rest_is_met(
    monkeypatch, target_parse_rate, class_rows_generated
):
    import train.tiny.warmup as warmup

    rows = make_visible_rows(8, n_frames=4, size_px=32, seed=0, organs=("kidney",))
    train_rows, val_rows, class_rows = rows[:4], rows[4:5], rows[5:8]
    asked: list[int] = []
    real = warmup.report_parse_rate

    def counting(model, processor, rows_, *args, **kwargs):
        asked.append(len(rows_))
        return real(model, processor, rows_, *args, **kwargs)

    monkeypatch.setattr(warmup, "report_parse_rate", counting)
    processor = build_processor()
    lines: list[str] = []
    with pytest.raises(TrainConfigError):
        lm_warmup(
            build_model(processor.tokenizer, seed=0),
            processor,
            train_rows,
            val_rows,
            class_rows=class_rows,
            max_steps=1,
            learning_rate=1e-3,
            batch_size=1,
            verifier_batch_size=1,
            eval_every=1,
            target_parse_rate=target_parse_rate,
            max_new_tokens=4,
            require_both_classes=True,
            log=lines.append,
        )
    assert asked == [1] + [3] * class_rows_generated  # the held-out row; the 3 class rows only when the rest is met
    assert lines[0].endswith("; not both classes claimed on the 3 class rows, 1 rows")


def test_a_rows_lesion_frames_are_asked_key_frame_first_then_the_outermost() -> None:
    rows = [
        r
        for r in make_visible_rows(8, n_frames=20, size_px=64, seed=1, organs=("liver",), span=3)
        if r["has_lesion"] and 4 <= r["key_slice_frame"] <= 17
    ][:2]
    assert len(rows) == 2
    asked = _eval_frames(rows, lesion_span=3, max_frames=28)  # half of them, 14, show the lesion
    lesion = [(i, t.distance) for i, t in asked if t.present]
    # round-robin over the 2 rows: each row's key frame, then its two frames 3 away, then 2 away, then 1 away
    assert lesion == [
        (0, 0),
        (1, 0),
        (0, 3),
        (1, 3),
        (0, 3),
        (1, 3),
        (0, 2),
        (1, 2),
        (0, 2),
        (1, 2),
        (0, 1),
        (1, 1),
        (0, 1),
        (1, 1),
    ]
    first_row_frames = [t.frame + 1 - rows[0]["key_slice_frame"] for i, t in asked if i == 0 and t.present]
    assert first_row_frames == [0, -3, 3, -2, 2, -1, 1]  # the earlier frame first at a tie


def test_the_size_rate_reads_the_slice_and_gates_only_where_asked() -> None:
    key = FrameTarget(9, "x", True, ("left",), "hypo", long_axis_mm=56.0, distance=0)
    outer = FrameTarget(12, "y", True, ("left",), "hypo", long_axis_mm=20.0, distance=3)
    asked = [("kidney", key), ("kidney", key), ("kidney", outer), ("kidney", outer)]
    texts = [
        "A hypodense lesion in the left kidney measures 5.6 x 3.9 cm.",  # the key's size
        "A hypodense lesion in the left kidney measures 4.0 x 2.8 cm.",  # 4.0 vs 5.6: beyond 20 %
        "A hypodense lesion in the left kidney measures 2.3 x 1.6 cm.",  # 2.3 vs 2.0: within 0.5 cm / 20 %
        "A hypodense lesion in the left kidney measures 5.6 x 3.9 cm.",
    ]  # the key's size on an outer slice
    acc = score_verifier(asked, texts)
    assert acc["size"] == 0.5 and acc["sensitivity"] == acc["location"] == acc["attenuation"] == 1.0
    assert acc["n_key_frames"] == 2 and acc["specificity"] is None
    assert verifier_gaps(acc, 0.9) == ["specificity n/a < 90%"]  # size is not a default gate
    assert verifier_gaps(acc, 0.9, ("sensitivity", "size")) == ["size 50% < 90%"]
    assert format_verifier(acc) == "sens 100%, spec n/a, location 100%, attenuation 100%, size 50% (4 + 0 frames)"


def test_an_unknown_verifier_gate_is_one_line_naming_the_gates() -> None:
    rows = make_visible_rows(2, n_frames=4, size_px=32, seed=0, organs=("kidney",))
    with pytest.raises(TrainConfigError) as err:
        lm_warmup(
            None,
            None,
            rows[:1],
            rows[1:],
            max_steps=2,
            learning_rate=1e-3,
            eval_every=1,
            verifier_gates=("sensitivity", "sizes"),
        )
    assert str(err.value) == (
        "LM warm-up: unknown verifier gates ['sizes']; the gates are "
        "['sensitivity', 'specificity', 'location', 'attenuation', 'size']"
    )


def test_held_out_frames_go_round_robin_over_rows_and_the_blind_partner_shares_the_organ() -> None:
    negatives = [{"organ": "liver", "n_frames": 8, "has_lesion": False} for _ in range(3)]
    asked = _eval_frames(negatives, lesion_span=3, max_frames=4)
    assert [(i, t.frame) for i, t in asked] == [(0, 0), (1, 0), (2, 0), (0, 1)]
    rows = [{"organ": o} for o in ("liver", "kidney", "liver", "pancreas")]
    assert [_blind_partner(rows, i) for i in range(4)] == [2, 2, 0, 0]


def test_warmup_trains_reports_on_its_report_rows_and_the_verifier_on_its_rows(monkeypatch):
    import train.tiny.warmup as warmup

    rows = make_visible_rows(8, n_frames=4, size_px=32, seed=0, organs=("kidney",))
    reports = [dict(r, report=f"<findings>row {i}</findings>") for i, r in enumerate(rows[:6])]
    collated: list[str] = []
    paired: list[list[str]] = []

    class Collator(warmup.SFTCollator):
        def __call__(self, batch):
            collated.extend(r["report"] for r in batch)
            return super().__call__(batch)

    class Pairs(warmup.BalancedPairs):
        def __init__(self, rows_, *args):
            paired.append([r["report"] for r in rows_])
            super().__init__(rows_, *args)

    monkeypatch.setattr(warmup, "SFTCollator", Collator)
    monkeypatch.setattr(warmup, "BalancedPairs", Pairs)
    processor = build_processor()
    knobs = {"max_steps": 2, "learning_rate": 1e-3, "batch_size": 3, "verifier_batch_size": 2, "eval_every": 2}
    result = lm_warmup(
        build_model(processor.tokenizer, seed=0),
        processor,
        rows[:6],
        rows[6:],
        report_rows=reports,
        target_parse_rate=0.0,
        max_new_tokens=4,
        lesion_span=1,
        log=lambda _: None,
        **knobs,
    )
    assert result.steps == 2 and len(collated) == 6
    assert set(collated) <= {r["report"] for r in reports}  # every report target is a report row's
    assert paired == [[r["report"] for r in rows[:6]]]  # the verifier pairs are the gold rows'
    with pytest.raises(TrainConfigError, match="no report rows to train on"):
        lm_warmup(build_model(processor.tokenizer, seed=0), processor, rows[:6], rows[6:], report_rows=[], **knobs)
