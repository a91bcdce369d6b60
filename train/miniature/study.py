"""The paper's experiment in miniature, on CPU: does GRPO with r_e + r_f + r_c beat SFT and a control?

Stages (each writes its folder under `output_dir` and a `<stage>/done.json`; a rerun skips finished stages):

1. `data`: a synthetic sft table (`train.tiny.synthetic.make_visible_rows`) whose findings are visible only in the frames:
   presence, size class (disc radius), location (left/right half), attenuation (disc intensity), key frame (largest
   disc). The prompt names the organ and the frame count only.
2. `warmup` (not the paper): a tiny Qwen3-VL learns the report and verifier languages (`train.tiny.warmup`); it stops on
   the held-out parse-rate criterion, or fails in one line at its cap.
3. `sft`: the paper's SFT freezing (ViT + projector train, LLM frozen) for a few steps: partial skill.
4. `grpo_a` (r_e + r_f + r_c, verifier on), `grpo_b` (r_e + r_f), `grpo_c` (r_e + r_f + r_c at learning rate 0:
   the control), all from the SFT checkpoint, same seed, so the same prompts in the same order.
5. `more_sft` (d), `more_sft_llm` (e): SFT continued from the SFT checkpoint on as many train rows as GRPO's prompts,
   with the paper's SFT freezing (d) or GRPO's (e): is GRPO's gain more than further supervised training gives?
6. `eval`: greedy reports of every finished model on the held-out test split, scored and tabulated with `emrl eval`'s
   machinery (`emrl_data.text.evaluation`: Table 1/2, 95 % bootstrap intervals); `results.json`, `results.md` and
   `reward_curves.png` in `output_dir` (the claim check, tables and curves: `train.miniature.run_report`).

    python -m train.miniature --config train/configs/miniature.yaml --output_dir miniature-output
    python -m train.miniature --config train/configs/miniature.yaml --output_dir miniature-seeds --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import yaml

from emrl_data.atomic_write import write_text_atomic
from emrl_data.text.evaluation import evaluate, score_predictions, write_evaluation
from emrl_data.text.scoring import ScoringConfig
from train.checks import SeedMissed, TrainConfigError, bar_only
from train.miniature.config import MiniatureConfig, load_config
from train.miniature.diagnose import diagnose_checkpoint, record_rewards, spread_per_step, verifier_by_distance
from train.miniature.noise import corrupt_gold, move_key_frames, random_visible_keys
from train.miniature.power import check_power, names_lesion_frame
from train.miniature.run_report import claim_check, paired_against_a, pct, results_markdown, save_curves_png
from train.miniature.runs import CROSS_VIEW, GRPO_RUNS, MODELS, MORE_SFT_RUNS
from train.miniature.seeds import seed_dir, write_seeds_summary
from train.tiny.synthetic import make_visible_rows, write_rows


logger = logging.getLogger(__name__)

ALL_STAGES = (
    "data",
    "warmup",
    "sft",
    "grpo_a",
    "grpo_b",
    "grpo_c",
    "grpo_f",
    "grpo_g",
    "grpo_h",
    "more_sft",
    "more_sft_llm",
    "eval",
)
STAGES = tuple(s for s in ALL_STAGES if s not in ("grpo_f", "grpo_g", "grpo_h"))  # the default `models`' stages
DIAGNOSE = "diagnose"  # on request only (`--stages diagnose`): the reward signal at the SFT model (miniature_diagnose)
# The configuration keys the warm-up's error lines name (`train.tiny.warmup.WarmupPlan.keys`).
MINIATURE_WARMUP_KEYS = {
    "max_steps": "warmup_max_steps",
    "eval_every": "warmup_eval_every",
    "learning_rate": "warmup_learning_rate",
}
SHARED_STAGES = ("data", "warmup", "sft")  # what `--reuse_from` copies: the stages before GRPO
SFT_ROWS = "sft_rows"  # under data/: SFT's own rows where its key frame is not the gold's
POLICY_MISSED = "SFT policy check:"  # how an exclusion's reason names the SFT policy's gate


class PolicyMissed(SeedMissed):
    """SFT's fresh eval named a lesion frame on fewer positive test rows than `sft_policy_gate`."""


def policy_check(scored: list[dict[str, Any]], rows: list[dict[str, Any]], span: int) -> dict[str, Any]:
    """Return {positive_rows, lesion_frame}: the share of the positive rows (`rows`, their scored reports `scored`, in
    the same order) whose report claims a lesion and names a frame within `span` frames of the key frame."""
    truth = [s | {"key_slice_frame": r["key_slice_frame"]} for s, r in zip(scored, rows, strict=True)]
    positives = [r for r in truth if r["has_lesion"]]
    hits = sum(names_lesion_frame(r, span) for r in positives)
    return {"positive_rows": len(positives), "lesion_frame": hits / len(positives) if positives else 0.0}


WARMUP_REPORTS = "warmup_reports"  # under data/: the warm-up's report rows where their key frame is not the gold's
GRPO_ONLY_KEYS = frozenset(
    {
        "models",
        "negative_rows",
        "grpo_steps",
        "grpo_learning_rate",
        "grpo_prompts_per_step",
        "num_generations",
        "grpo_temperature",
        "max_completion_length",
        "beta",
        "verifier_max_new_tokens",
        "n_bootstrap",
        "diagnose_prompts",
        "diagnose_temperatures",
    }
)


def check_split(rows: list[dict[str, Any]], cfg: MiniatureConfig) -> None:
    """Refuse a test split with fewer than `min_test_rows_per_class` positive or negative rows of some organ."""
    for organ in cfg.organs:
        for positive in (True, False):
            n = sum(1 for r in rows if r["organ"] == organ and bool(r["has_lesion"]) == positive)
            if n < cfg.min_test_rows_per_class:
                kind = "positive" if positive else "negative"
                raise TrainConfigError(
                    f"miniature: the test split has {n} {kind} {organ} rows, fewer than min_test_rows_per_class="
                    f"{cfg.min_test_rows_per_class}, too few for its 95 % intervals; raise n_test (now {cfg.n_test})"
                )


WARMUP_POOL_SEED = 2000  # the warm-up pool's rows are drawn with seed + this (train: seed, test: seed + 1000)


def warmup_pool_seed(seed: int) -> int:
    """Return the seed of a run's warm-up pool: its rows (and case ids) differ from the train and test rows'."""
    return seed + WARMUP_POOL_SEED


def more_sft_steps(cfg: MiniatureConfig) -> int:
    """Steps of (d) and (e): as many train rows as GRPO's prompts (grpo_steps x grpo_prompts_per_step), rounded up."""
    return math.ceil(cfg.grpo_steps * cfg.grpo_prompts_per_step / cfg.sft_batch_size)


class Miniature:
    """Runs the stages in order, skipping those with a `done.json` (resumable)."""

    def __init__(self, cfg: MiniatureConfig, output_dir: str | Path, log: Any = None):
        self.cfg = cfg
        self.out = Path(output_dir)
        self.log = log or (lambda line: print(line, flush=True))

    def done(self, stage: str) -> dict[str, Any] | None:
        """Return the stage's record when it finished, else None."""
        path = self.out / stage / "done.json"
        return json.loads(path.read_text()) if path.exists() else None

    def _finish(self, stage: str, record: dict[str, Any]) -> dict[str, Any]:
        write_text_atomic(json.dumps(record, indent=2) + "\n", self.out / stage / "done.json")
        return record

    def _claim_folder(self) -> None:
        """Write config.json into `output_dir`, refusing a folder that holds another configuration's run."""
        self.out.mkdir(parents=True, exist_ok=True)
        config_path = self.out / "config.json"
        as_dict = asdict(self.cfg)
        if config_path.exists() and json.loads(config_path.read_text()) != as_dict:
            raise TrainConfigError(
                f"{self.out} holds a miniature run with another configuration ({config_path}); "
                "pass a new --output_dir or delete that folder"
            )
        config_path.write_text(json.dumps(as_dict, indent=2) + "\n")

    def reuse(self, source: str | Path, stages: tuple[str, ...] = SHARED_STAGES) -> list[str]:
        """Copy the finished `stages` of `source` (default data, warm-up and SFT: a GRPO variant shares them); return
        those copied.

        `source` must hold a run whose configuration equals this one on every key outside `GRPO_ONLY_KEYS` (and, when
        only the warm-up is copied, `gold_noise`: the warm-up reads the clean rows).
        """
        source = Path(source)
        config_path = source / "config.json"
        if not config_path.exists():
            raise TrainConfigError(f"--reuse_from {source}: no config.json there; pass a miniature output folder")
        theirs, ours = json.loads(config_path.read_text()), asdict(self.cfg)
        free = GRPO_ONLY_KEYS | ({"gold_noise", "key_frame_noise"} if stages == ("warmup",) else set())
        differ = sorted(k for k in set(theirs) | set(ours) if k not in free and theirs.get(k) != ours.get(k))
        if differ:
            raise TrainConfigError(
                f"--reuse_from {source}: its configuration differs on {differ}, which the data, warm-up or SFT "
                f"depend on; only {sorted(GRPO_ONLY_KEYS)} may differ"
            )
        self._claim_folder()
        copied = []
        for stage in stages:
            if self.done(stage) is not None:
                continue
            if not (source / stage / "done.json").exists():
                raise TrainConfigError(f"--reuse_from {source}: stage {stage} has not finished there; run it first")
            tmp = self.out / f"{stage}.copying"
            for path in (tmp, self.out / stage):  # an interrupted copy or an unfinished attempt: replaced as a whole
                if path.exists():
                    shutil.rmtree(path)
            shutil.copytree(source / stage, tmp)
            tmp.rename(self.out / stage)
            copied.append(stage)
        self.log(f"== reused {copied or 'nothing'} from {source}")
        return copied

    def stages(self) -> tuple[str, ...]:
        """Return the stages of the configured `models`, in order: data, warmup, the models' stages, eval."""
        return self.stages_of(self.cfg.models)

    @staticmethod
    def stages_of(models: list[str]) -> tuple[str, ...]:
        """Return the stages that train and evaluate `models` (MODELS keys), in order."""
        return tuple(s for s in ALL_STAGES if s in ("data", "warmup", "eval") or s in models)

    def run(self, stages: tuple[str, ...] | None = None) -> dict[str, Any]:
        """Run (or resume) the stages (default: `stages()`); return the eval record (or the last stage's)."""
        stages = self.stages() if stages is None else stages
        self._check_before_training(stages)
        self._claim_folder()
        record: dict[str, Any] = {}
        for stage in stages:
            previous = self.done(stage)
            if stage == "eval" and previous is not None and previous.get("models") != self.finished_models():
                self.log("== eval: a model finished since it ran; re-tabulating (kept predictions are reused)")
                previous = None
            if previous is not None:
                self.log(f"== {stage}: done earlier ({previous.get('seconds', 0):.0f} s), skipped")
                record = previous
                if stage == "sft":  # a resumed run meets the same gate
                    self._gate_policy(record)
                continue
            self.log(f"== {stage}")
            start = time.perf_counter()
            record = getattr(self, f"_stage_{stage}")(stage)
            record["seconds"] = time.perf_counter() - start
            self._finish(stage, record)
            self.log(f"   {stage} finished in {record['seconds']:.0f} s")
            if stage == "sft":
                self._gate_policy(record)
        return record

    def _check_before_training(self, stages: tuple[str, ...]) -> None:
        """One-line errors before any stage runs: a test split too small for the intervals, a random-frame run
        without another row in its step."""
        cfg = self.cfg
        check_power(cfg.n_test, len(cfg.organs), cfg.min_test_rows_per_class, cfg.n_bootstrap)
        if "grpo_g" in stages and self.done("grpo_g") is None and cfg.grpo_prompts_per_step < 2:
            raise TrainConfigError(
                f"miniature: run grpo_g (cross_view=random_frame) shows another row's frame, but grpo_prompts_per_step="
                f"{cfg.grpo_prompts_per_step} leaves no other row in a step; use at least 2"
            )

    # -- stages ----------------------------------------------------------------------------------------------------

    def _stage_data(self, stage: str) -> dict[str, Any]:
        cfg = self.cfg
        kw: dict[str, Any] = {
            "n_frames": cfg.n_frames,
            "size_px": cfg.size_px,
            "organs": tuple(cfg.organs),
            "sizes_mm": tuple(float(v) for v in cfg.sizes_mm),
            "span": cfg.lesion_span,
        }
        key_boxes: list[list[int] | None] = []
        clean = make_visible_rows(cfg.n_train, split="train", seed=cfg.seed, boxes_out=key_boxes, **kw)
        test = make_visible_rows(cfg.n_test, split="test", seed=cfg.seed + 1000, **kw)
        check_split(test, cfg)
        train, noise_log = corrupt_gold(clean, cfg.gold_noise, cfg.seed, cfg.sizes_mm)
        if cfg.key_frame_noise > 0:
            train, noise_log = move_key_frames(clean, cfg.key_frame_noise, cfg.seed)
        write_rows(self.out / stage, {"train": train, "test": test})
        if cfg.warmup_pool_rows > 0:  # the warm-up's own rows: no row SFT or GRPO trains on, so no clean label of one
            pool_boxes: list[list[int] | None] = []
            pool_seed = warmup_pool_seed(cfg.seed)
            pool = make_visible_rows(cfg.warmup_pool_rows, split="train", seed=pool_seed, boxes_out=pool_boxes, **kw)
            write_rows(self.out / stage / "warmup_pool", {"train": pool})
        else:  # the warm-up's rows are the clean training rows (its verifier reads the pixels)
            pool, pool_boxes, pool_seed = clean, key_boxes, cfg.seed  # random keys: the same draws as SFT's
            write_rows(self.out / stage / "clean", {"train": clean})
        warmup_moved = self._write_warmup_reports(stage, pool, pool_boxes, pool_seed)
        (self.out / stage / "noise.json").write_text(json.dumps(noise_log, indent=2) + "\n")
        moved = self._write_sft_rows(stage, clean, key_boxes)  # drawn in the true lesion, whatever GRPO's gold
        pos = {s: sum(r["has_lesion"] for r in rows) for s, rows in (("train", train), ("test", test))}
        self.log(
            f"   {len(train)} train rows ({pos['train']} positive), {len(test)} test rows ({pos['test']} positive)"
        )
        return {
            "n_train": len(train),
            "n_test": len(test),
            "positives": pos,
            "gold_noise": cfg.gold_noise,
            "corrupted": {f: sum(e["field"] == f for e in noise_log) for f in sorted({e["field"] for e in noise_log})},
            "sft_key_frame": cfg.sft_key_frame,
            "sft_keys_moved": moved,
            "warmup_key_frame": cfg.warmup_key_frame,
            "warmup_report_keys_moved": warmup_moved,
        }

    def _write_warmup_reports(
        self, stage: str, pool: list[dict[str, Any]], boxes: list[list[int] | None], seed: int
    ) -> int:
        """With `warmup_key_frame: random_visible`, write the warm-up's report rows (`data/warmup_reports`: its rows
        with the key frame drawn among the lesion's frames, `warmup_keys.json` the log); the verifier task keeps the
        gold rows. Return how many rows name another frame than the gold's."""
        if self.cfg.warmup_key_frame == "gold":
            return 0
        rows, log = random_visible_keys(pool, boxes, size_px=self.cfg.size_px, span=self.cfg.lesion_span, seed=seed)
        write_rows(self.out / stage / WARMUP_REPORTS, {"train": rows})
        (self.out / stage / "warmup_keys.json").write_text(json.dumps(log, indent=2) + "\n")
        self.log(
            f"   the warm-up's report targets drawn among the lesion's frames: {len(log)} rows name another frame"
        )
        return len(log)

    def _write_sft_rows(self, stage: str, train: list[dict[str, Any]], key_boxes: list[list[int] | None]) -> int:
        """With `sft_key_frame: random_visible`, write SFT's rows (`data/sft_rows`: the key frame drawn among the
        frames of the clean rows' lesion, so under key-frame noise too; `sft_keys.json` its log); return how many rows
        name another frame than the gold's."""
        cfg = self.cfg
        if cfg.sft_key_frame == "gold":
            return 0
        rows, log = random_visible_keys(train, key_boxes, size_px=cfg.size_px, span=cfg.lesion_span, seed=cfg.seed)
        write_rows(self.out / stage / SFT_ROWS, {"train": rows})
        (self.out / stage / "sft_keys.json").write_text(json.dumps(log, indent=2) + "\n")
        self.log(f"   SFT's key frame drawn among the lesion's frames: {len(log)} rows name another frame")
        return len(log)

    def _rows(self, split: str, clean: bool = False, folder: str = "") -> list[dict[str, Any]]:
        """Return a split's rows (`clean`: the warm-up's rows, its pool or the training rows before any noise; `folder`:
        a table of its own under data/)."""
        # lazy: train.data loads transformers: +6.7 s (measured), only once rows are read
        from train.data import load_split

        if clean:
            folder = "warmup_pool" if self.cfg.warmup_pool_rows > 0 else "clean"
        return [dict(r) for r in load_split(self.out / "data" / folder, split)]

    def _stage_warmup(self, stage: str) -> dict[str, Any]:
        # torch, and the modules that load it, wait until a stage runs (this module stays light to import)
        # lazy: torch adds 2-3 s to every process that imports this module (measured); only the model stages need it
        import torch

        from train.tiny.model import build_model, build_processor  # lazy: the torch stack (see torch above)
        from train.tiny.warmup import held_out_indices, lm_warmup  # lazy: the torch stack (see torch above)

        # lazy: the torch stack (see torch above)
        from train.tiny.warmup_checks import format_verifier, verifier_accuracy

        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        rows = self._rows("train", clean=True)
        val = set(held_out_indices(len(rows), cfg.warmup_val_rows))
        reports = rows if cfg.warmup_key_frame == "gold" else self._rows("train", folder=WARMUP_REPORTS)
        processor = build_processor()
        model = build_model(processor.tokenizer, seed=cfg.seed)
        result = lm_warmup(
            model,
            processor,
            [r for i, r in enumerate(rows) if i not in val],
            [rows[i] for i in sorted(val)],
            report_rows=[r for i, r in enumerate(reports) if i not in val],
            max_steps=cfg.warmup_max_steps,
            learning_rate=cfg.warmup_learning_rate,
            batch_size=cfg.warmup_batch_size,
            verifier_batch_size=cfg.warmup_verifier_batch_size,
            eval_every=cfg.warmup_eval_every,
            target_parse_rate=cfg.warmup_target_parse_rate,
            max_new_tokens=cfg.eval_max_new_tokens,
            seed=cfg.seed,
            log=self.log,
            target_sampled_parse_rate=cfg.warmup_target_sampled_parse_rate,
            lesion_span=cfg.lesion_span,
            target_verifier_accuracy=cfg.warmup_target_verifier_accuracy,
            verifier_gates=tuple(cfg.warmup_verifier_gates),
            gate_checks=cfg.warmup_gate_checks,
            verifier_eval_frames=cfg.verifier_eval_frames,
            verifier_max_new_tokens=cfg.verifier_max_new_tokens,
            keys=MINIATURE_WARMUP_KEYS,
        )
        blind = verifier_accuracy(
            model,
            processor,
            [rows[i] for i in sorted(val)],
            cfg.lesion_span,
            blind=True,
            max_frames=cfg.verifier_eval_frames,
            max_new_tokens=cfg.verifier_max_new_tokens,
        )
        self.log(f"   verifier, blind control (a frame of another row): {format_verifier(blind)}")
        record = {
            "steps": result.steps,
            "parse_rates": result.parse_rates,
            "verifier_accuracy": result.verifier_accuracy,
            "verifier_blind": blind,
        }
        if cfg.verifier_distance_rows > 0:  # the held-out rows' frames by distance from the key frame, size included
            record["verifier_by_distance"] = distances = verifier_by_distance(
                model,
                processor,
                [rows[i] for i in sorted(val)],
                cfg.lesion_span,
                cfg.verifier_distance_rows,
                cfg.verifier_max_new_tokens,
            )
            self.log(
                "   verifier by distance from the key frame (presence / size of the key): "
                + ", ".join(f"d={d} {pct(r['presence'])}/{pct(r['size_key'])}" for d, r in distances.items())
            )
        model.save_pretrained(self.out / stage)
        processor.save_pretrained(self.out / stage)
        return record

    def _stage_sft(self, stage: str) -> dict[str, Any]:
        record = self._sft(stage, start="warmup", freezing="sft", steps=self.cfg.sft_steps)
        if self._policy_gated():  # a fresh eval of the finished model; the eval stage reuses its reports
            rows = self._rows("test")
            _, scored = self._eval_model("eval", "sft", rows)
            record["policy_check"] = policy_check(scored, rows, self.cfg.lesion_span)
        return record

    def _policy_gated(self) -> bool:
        """The gate holds on the clean run's SFT: a noisy level's SFT learns from its noise, the treatment it studies."""
        return self.cfg.sft_policy_gate > 0 and self.cfg.gold_noise == 0 and self.cfg.key_frame_noise == 0

    def _gate_policy(self, record: dict[str, Any]) -> None:
        """Raise `PolicyMissed` when SFT's fresh eval names a lesion frame on fewer positive test rows than
        `sft_policy_gate`."""
        gate, check = self.cfg.sft_policy_gate, record.get("policy_check")
        if not self._policy_gated():
            return
        if check is None:
            raise TrainConfigError(f"miniature: {self.out / 'sft'} ran without sft_policy_gate; rerun its SFT stage")
        line = f"{check['lesion_frame']:.1%} of {check['positive_rows']} positive test rows"
        self.log(f"   SFT policy check: the named frame shows the lesion on {line} (gate {gate:.0%})")
        if check["lesion_frame"] < gate:
            raise PolicyMissed(
                f"{POLICY_MISSED} the greedy reports name a frame showing the lesion on {line}, below "
                f"sft_policy_gate={gate}; GRPO would start from a policy that has not found the lesion"
            )

    def _more_sft(self, stage: str) -> dict[str, Any]:
        return self._sft(stage, start="sft", freezing=MORE_SFT_RUNS[stage], steps=more_sft_steps(self.cfg))

    _stage_more_sft = _stage_more_sft_llm = _more_sft

    def _sft(self, stage: str, *, start: str, freezing: str, steps: int) -> dict[str, Any]:
        """Supervised steps from the `start` stage's checkpoint, training the parameter groups of `freezing`."""
        # torch, and the modules that load it, wait until a stage runs
        import torch  # lazy: torch (see _stage_warmup)

        from train.data import load_split  # lazy: transformers (see _rows)

        # lazy: the torch stack (see _stage_warmup)
        from train.sft import build_sft_trainer, load_policy, make_sft_config

        cfg = self.cfg
        if self.done(start) is None:
            raise TrainConfigError(f"miniature: stage {stage} needs the {start} stage in {self.out}; run it first")
        torch.manual_seed(cfg.seed)
        model, processor = load_policy(str(self.out / start))
        args = make_sft_config(
            output_dir=str(self.out / stage),
            max_steps=steps,
            learning_rate=cfg.sft_learning_rate,
            lr_scheduler_type="constant",
            per_device_train_batch_size=cfg.sft_batch_size,
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
            logging_steps=10,
            save_strategy="no",
            seed=cfg.seed,
            disable_tqdm=True,
        )
        trainer = bar_only(
            build_sft_trainer(model, processor, load_split(self._sft_rows_dir(), "train"), args, stage=freezing)
        )
        trainer.train()
        trainer.save_model(str(self.out / stage))
        processor.save_pretrained(str(self.out / stage))
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return {"steps": trainer.state.global_step, "losses": losses, "start": start, "freezing": freezing}

    def _sft_rows_dir(self) -> Path:
        """The table SFT reads: the training rows, or with `sft_key_frame: random_visible` their copy whose key frame
        is drawn among the lesion's frames (GRPO reads the training rows, gold key frames)."""
        return self.out / "data" / (SFT_ROWS if self.cfg.sft_key_frame != "gold" else "")

    def _grpo(self, stage: str) -> dict[str, Any]:
        # torch, and the modules that load it, wait until a stage runs
        import torch  # lazy: torch (see _stage_warmup)
        from trl import GRPOConfig  # lazy: the torch stack (see _stage_warmup)

        from train.data import load_split  # lazy: transformers (see _rows)
        from train.grpo import build_grpo_trainer, reward_curve  # lazy: the torch stack (see _stage_warmup)

        cfg = self.cfg
        rewards, control = GRPO_RUNS[stage]
        torch.manual_seed(cfg.seed)
        args = GRPOConfig(
            output_dir=str(self.out / stage),
            num_generations=cfg.num_generations,
            per_device_train_batch_size=cfg.grpo_prompts_per_step * cfg.num_generations,
            max_completion_length=cfg.max_completion_length,
            max_steps=cfg.grpo_steps,
            beta=cfg.beta,
            learning_rate=0.0 if control else cfg.grpo_learning_rate,
            lr_scheduler_type="constant",
            logging_steps=1,
            use_cpu=True,
            bf16=False,
            report_to="none",
            save_strategy="no",
            loss_type="grpo",
            seed=cfg.seed,
            temperature=cfg.grpo_temperature,
            disable_tqdm=True,
        )
        trainer = build_grpo_trainer(
            str(self.out / "sft"),
            load_split(self.out / "data", "train"),
            args,
            rewards=rewards,
            verifier_max_new_tokens=cfg.verifier_max_new_tokens,
            **reward_options(stage, cfg.negative_rows),
        )
        bar_only(trainer)  # the per-step metrics stay in trainer_state.json and done.json
        trainer.add_callback(_progress_callback(self.log, every=10))
        calls = record_rewards(trainer)
        trainer.train()
        spread = spread_per_step(calls, [float(w) for w in trainer.reward_weights], cfg.num_generations)
        self.log(
            f"   groups without reward spread (std <= {spread['tol']:g}): {spread['total_without_signal']} of "
            f"{spread['total_groups']}"
        )
        trainer.save_model(str(self.out / stage))
        trainer.save_state()
        trainer.processing_class.save_pretrained(str(self.out / stage))
        curve = reward_curve(trainer.state.log_history)
        logs = [h for h in trainer.state.log_history if "frac_reward_zero_std" in h]
        line = " ".join(f"{v:.2f}" for _, v in curve.get("reward", []))
        self.log(f"   reward per step: {line}")
        return {
            "rewards": rewards,
            "cross_view": CROSS_VIEW[stage],
            "learning_rate": args.learning_rate,
            "curve": curve,
            "frac_reward_zero_std": [h["frac_reward_zero_std"] for h in logs],
            "spread": spread,
            "kl": [h.get("kl") for h in logs],
        }

    _stage_grpo_a = _stage_grpo_b = _stage_grpo_c = _stage_grpo_f = _stage_grpo_g = _stage_grpo_h = _grpo

    def _stage_diagnose(self, stage: str) -> dict[str, Any]:
        """Sample `num_generations` completions of the SFT model on `diagnose_prompts` train prompts per temperature;
        write `diagnose/diagnose.json` and `diagnose/diagnose.md` (see `train.miniature.diagnose`)."""
        cfg = self.cfg
        if self.done("sft") is None:
            raise TrainConfigError(f"miniature: stage diagnose needs the sft stage in {self.out}; run it first")
        rows = self._rows("train")[: cfg.diagnose_prompts]
        summaries = diagnose_checkpoint(self.out / "sft", rows, cfg, self.out / stage, log=self.log)
        return {"summaries": [{k: v for k, v in s.items() if k != "examples"} for s in summaries]}

    def _stage_eval(self, stage: str) -> dict[str, Any]:
        cfg = self.cfg
        names = self.finished_models()
        missing = [n for n in ("sft",) if n not in names]
        if missing:
            raise TrainConfigError(f"miniature: eval needs the stages {missing} in {self.out}; run them first")
        if "grpo_c" not in names:  # lr 0 leaves the weights unchanged: (c)'s greedy reports are SFT's
            self.log("   (c) has not run: the claim is checked against SFT only, whose tables (c) reproduces")
        rows = self._rows("test")
        results: dict[str, Any] = {}
        records: dict[str, list[dict[str, Any]]] = {}
        for name in names:
            results[name], records[name] = self._eval_model(stage, name, rows)
        claim = claim_check(results)
        paired = paired_against_a(records, cfg.n_bootstrap, cfg.seed)
        curves = {name: self.done(name)["curve"] for name in GRPO_RUNS if name in names}  # type: ignore[index]
        out = {
            "config": asdict(cfg),
            "models": results,
            "claim": claim,
            "paired": paired,
            "reward_curves": curves,
            "stages": {s: self.done(s) for s in ALL_STAGES if s != "eval" and self.done(s) is not None},
        }
        (self.out / "results.json").write_text(json.dumps(out, indent=2, default=str, allow_nan=False) + "\n")
        (self.out / "results.md").write_text(results_markdown(results, claim, paired))
        save_curves_png(curves, self.out / "reward_curves.png")
        self.log((self.out / "results.md").read_text())
        return {"claim": claim, "models": names}

    def _eval_model(self, stage: str, name: str, rows: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict]]:
        """Greedy reports of one finished model on the test rows (kept for reruns), scored; the verifier's accuracy
        for SFT and the GRPO runs. Returns (its results entry, the per-row scored records)."""
        # torch, and the modules that load it, wait until a model is evaluated
        import torch  # lazy: torch (see _stage_warmup)

        # lazy: the torch stack (see _stage_warmup)
        from model_io.processor import load_model_and_processor, user_messages

        # lazy: the torch stack (see _stage_warmup)
        from train.tiny.warmup_checks import format_verifier, generate_texts, verifier_accuracy

        cfg, label, folder = self.cfg, MODELS[name], self.out / stage / name
        kept, kept_verifier = folder / "predictions.jsonl", folder / "verifier.json"
        wants_verifier = name == "sft" or name in GRPO_RUNS
        model = processor = None
        if not kept.exists() or (wants_verifier and not kept_verifier.exists()):
            model, processor = load_model_and_processor(self.out / name, dtype=torch.float32)
        if kept.exists():  # an earlier eval of this finished model (a stage never reruns in its folder)
            texts = [json.loads(line)["prediction"] for line in kept.read_text().splitlines()]
        else:
            assert processor is not None  # loaded above: the predictions file is missing
            texts = generate_texts(
                model, processor, [user_messages(r["prompt"], r["frames"]) for r in rows], cfg.eval_max_new_tokens
            )
        preds = [
            {k: v for k, v in r.items() if k != "frames"} | {"prediction": t} for r, t in zip(rows, texts, strict=True)
        ]
        folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic("".join(json.dumps(p, default=str) + "\n" for p in preds), kept)
        verifier = None
        if wants_verifier and kept_verifier.exists():
            verifier = json.loads(kept_verifier.read_text())
        elif wants_verifier:
            assert processor is not None  # loaded above: the verifier file is missing
            kw: dict[str, Any] = {
                "max_frames": cfg.verifier_eval_frames,
                "max_new_tokens": cfg.verifier_max_new_tokens,
            }
            verifier = {
                "seen": verifier_accuracy(model, processor, rows, cfg.lesion_span, **kw),
                "blind": verifier_accuracy(model, processor, rows, cfg.lesion_span, blind=True, **kw),
            }
            if cfg.verifier_distance_rows > 0:  # by distance from the key frame, size included (diagnose)
                verifier["by_distance"] = verifier_by_distance(
                    model, processor, rows, cfg.lesion_span, cfg.verifier_distance_rows, cfg.verifier_max_new_tokens
                )
            write_text_atomic(json.dumps(verifier, indent=2) + "\n", kept_verifier)
        scored = score_predictions(preds)
        result = evaluate(scored, n_bootstrap=cfg.n_bootstrap, seed=cfg.seed)
        write_evaluation(result, folder, model=label)
        parse = sum(s["parse_failure"] is None for s in scored) / len(scored)
        entry = {
            "label": label,
            "parse_rate": parse,
            "average_bacc": result.average_bacc.to_json(),
            "k_hit": result.table2["average"]["k_hit"].to_json(),
            "verifier": verifier,
            "table2_overall": result.table2_overall.to_json(),
            "tables": result.to_json(),
        }
        line = (
            f"   {label}: average B-Acc {result.average_bacc.to_markdown()}, "
            f"K-Hit {result.table2['average']['k_hit'].to_markdown()}, parse {parse:.0%}"
        )
        if verifier is not None:
            line += f"; verifier {format_verifier(verifier['seen'])}, blind {format_verifier(verifier['blind'])}"
        self.log(line)
        return entry, scored

    def finished_models(self) -> list[str]:
        """Return the models (`MODELS` keys, in order) whose stage finished."""
        return [name for name in MODELS if self.done(name) is not None]


def reward_options(stage: str, negative_rows: str) -> dict[str, Any]:
    """Return one GRPO run's `build_grpo_trainer` keyword arguments for r_c's options: a `ScoringConfig` with its
    `cross_view` (`CROSS_VIEW[stage]`) and `negative_rows` (emrl_data/text/scoring.py). (h) sets r_c's lambda to 0:
    r_c is then the verifier's attribute term alone (0 where no frame is read, a parse failure included)."""
    extra: dict[str, Any] = {"iou_penalty": 0.0} if stage == "grpo_h" else {}
    return {"scoring_config": ScoringConfig(cross_view=CROSS_VIEW[stage], negative_rows=negative_rows, **extra)}


def _progress_callback(log: Any, every: int) -> Any:
    """Return a callback that logs `step, R, KL, elapsed` every `every` optimizer steps (a long run shows progress)."""
    from transformers import TrainerCallback  # lazy: transformers adds 7 s (measured); only a GRPO stage needs it

    start = time.perf_counter()

    class Progress(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "reward" in logs and state.global_step % every == 0:
                log(
                    f"   step {state.global_step}/{state.max_steps}: R {logs['reward']:.3f}, KL {logs.get('kl', 0):.3f}, "
                    f"{time.perf_counter() - start:.0f} s"
                )

    return Progress()


def main(argv: list[str] | None = None) -> None:
    """CLI: `python -m train.miniature --config YAML --output_dir DIR [--set key=value ...] [--stages ...]`."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument(
        "--stages",
        nargs="*",
        default=None,
        choices=(*ALL_STAGES, DIAGNOSE),
        help=f"default: those of the config's models; {DIAGNOSE} on its own, after sft",
    )
    parser.add_argument(
        "--reuse_from",
        default=None,
        metavar="DIR",
        help="copy the finished data, warm-up and SFT stages of DIR (GRPO settings may differ)",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        metavar="SEED",
        help="one run per seed in OUTPUT_DIR/seed-<SEED> (the seed key overridden), then seeds.md",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)
    cfg = load_config(args.config, overrides)
    if args.seeds is None:
        miniature = Miniature(cfg, args.output_dir)
        if args.reuse_from:
            miniature.reuse(args.reuse_from)
        miniature.run(None if args.stages is None else tuple(args.stages))
        return
    for seed in args.seeds:  # one full run per seed, each in its own folder (and resumable there)
        print(f"=== seed {seed}: {seed_dir(args.output_dir, seed)}", flush=True)
        miniature = Miniature(replace(cfg, seed=seed), seed_dir(args.output_dir, seed))
        if args.reuse_from:
            miniature.reuse(seed_dir(args.reuse_from, seed))
        miniature.run(None if args.stages is None else tuple(args.stages))
    if args.stages is None or "eval" in args.stages:
        write_seeds_summary(args.output_dir, args.seeds)
        print((Path(args.output_dir) / "seeds.md").read_text(), flush=True)
