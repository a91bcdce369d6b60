"""E-MRL reward functions for TRL's GRPOTrainer: r_e, r_f, r_c over `emrl_data.scoring` (SPEC §7, §9).

TRL calls each reward as `f(prompts=..., completions=..., completion_ids=..., **columns, trainer_state=...,
log_extra=..., log_metric=...)`, where `columns` are the `sft` columns repeated per completion (`organ`, `has_lesion`,
`long_axis_mm`, `location`, `attenuation`, `key_slice_frame`, `frames`, ...). Each returns `list[float | None]`;
None (r_c on a true negative) is excluded by TRL. `GRPOConfig.reward_weights` (0.3, 0.5, 0.2) combine them into R.

r_c re-queries the **current policy** with the verifier prompt on the predicted key frame alone, through the
trainer's own generation backend (`VideoGRPOTrainer._generate_single_turn`: HF generate under ZeRO-3 gathering, or
vLLM with this step's weights). The verifier runs exactly once per completion, on every rank, so collectives inside
generation stay in lockstep: a completion without a usable key frame is verified on its middle frame and the text is
not used (its r_c is computed with `key_slice=None`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from emrl_data.report import VERIFIER_PROMPT


logger = logging.getLogger(__name__)

TRUTH_KEYS = ("organ", "has_lesion", "long_axis_mm", "location", "attenuation", "key_slice_frame")
REWARD_NAMES = ("r_e", "r_f", "r_c")
DEFAULT_REWARD_WEIGHTS = {"r_e": 0.3, "r_f": 0.5, "r_c": 0.2}  # SPEC §7: R = 0.3 r_e + 0.5 r_f + 0.2 r_c


def _scoring() -> Any:
    """Import the shared scoring module (kept lazy so `train.data`/`train.sft` work without it)."""
    from emrl_data import scoring  # noqa: PLC0415

    return scoring


def completion_text(completion: Any) -> str:
    """Return the text of a TRL completion (`[{"role": "assistant", "content": str}]` or a plain string)."""
    if isinstance(completion, str):
        return completion
    content = completion[-1]["content"]
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)


def truth_rows(kwargs: Mapping[str, Sequence[Any]], n: int) -> list[dict[str, Any]]:
    """Return one truth row per completion from the repeated dataset columns (`TRUTH_KEYS`).

    Raises:
        KeyError: naming the missing columns.
    """
    missing = [k for k in TRUTH_KEYS if k not in kwargs]
    if missing:
        raise KeyError(f"Reward columns {missing} are missing; the dataset must carry the sft columns {TRUTH_KEYS}.")
    return [{k: kwargs[k][i] for k in TRUTH_KEYS} for i in range(n)]


def parse_key_slice(text: str, organ: str, n_frames: int) -> tuple[int | None, str | None]:
    """Return (1-based key frame or None, parse-failure reason or None) for one report.

    A key frame outside 1..n_frames counts as absent (reason "key_slice_out_of_range").
    """
    from emrl_data.parser import ParseFailure, parse_report  # noqa: PLC0415

    parsed = parse_report(text, organ)
    if isinstance(parsed, ParseFailure):
        return None, str(getattr(parsed, "reason", parsed))
    k = parsed.key_slice
    if k is None:
        return None, None
    if not 1 <= int(k) <= n_frames:
        return None, "key_slice_out_of_range"
    return int(k), None


class Verifier:
    """The E-MRL verifier: the current policy describes the key frame alone, answering `VERIFIER_PROMPT`.

    `trainer` is bound by `VideoGRPOTrainer.__init__`. Generation is greedy with `max_new_tokens` (the trainer's
    sampling config is swapped for the call, HF path); the vision tokens stay suppressed.

    Do not replace `_generate_single_turn` by a plain `model.generate` in a reward: rewards run inside `train()`, with
    the policy in train mode and activation checkpointing on, and then every checkpointed decoder layer drops
    `past_key_values` (transformers 5.17 `GradientCheckpointingLayer`). `generate` keeps feeding only the newest token
    to an empty cache, so from the second token on each step sees no context. TRL's path disables checkpointing for
    generation (`trl.models.utils._unwrap_model_for_generation`); `tests/train/test_stages.py` checks it against
    cache-free greedy decoding.
    """

    def __init__(self, prompt: str = VERIFIER_PROMPT, max_new_tokens: int = 128):
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.trainer: Any = None
        self.n_calls = 0  # generation calls (one per reward call)
        self.n_queries = 0  # verifier prompts answered (one per completion)

    def __call__(self, frames: Sequence[Any]) -> list[str]:
        """Return one verifier text per frame.

        Args:
            frames: one key frame per completion, each `(H, W)` uint8 or a PIL image.
        """
        from train.data import verifier_messages  # noqa: PLC0415 (keeps this module torch-free to import)

        if self.trainer is None:
            raise RuntimeError("Verifier.trainer is not bound; build the trainer with VideoGRPOTrainer.")
        trainer = self.trainer
        msgs = [verifier_messages(f, self.prompt) for f in frames]
        prompt_ids, images, mm = trainer._tokenize_prompts(msgs)
        saved = trainer.generation_config
        greedy = saved.__class__.from_dict(saved.to_dict())
        greedy.do_sample, greedy.max_new_tokens = False, self.max_new_tokens
        greedy.temperature, greedy.top_p, greedy.top_k, greedy.min_p = None, None, None, None
        trainer.generation_config = greedy
        try:
            completion_ids, _ = trainer._generate_single_turn(prompt_ids, images, mm, num_generations=1)
        finally:
            trainer.generation_config = saved
        self.n_calls += 1
        self.n_queries += len(frames)
        return trainer.processing_class.batch_decode(completion_ids, skip_special_tokens=True)


class _Reward:
    """Base: a named callable in TRL's reward signature (`__name__` names the logged column)."""

    __name__ = "reward"

    def __init__(self, scoring_config: Any = None):
        self.scoring_config = scoring_config

    def _cfg(self) -> Any:
        if self.scoring_config is None:
            self.scoring_config = _scoring().ScoringConfig()
        return self.scoring_config

    def __call__(self, prompts: Any = None, completions: Any = None, **kwargs: Any) -> list[float | None]:
        texts = [completion_text(c) for c in completions]
        return self.score(texts, truth_rows(kwargs, len(texts)), kwargs)

    def score(self, texts: list[str], rows: list[dict[str, Any]], kwargs: Mapping[str, Any]) -> list[float | None]:
        raise NotImplementedError


class ExistenceReward(_Reward):
    """r_e: 1 when the report's lesion presence matches the truth, else 0 (SPEC §7). Logs parse failures."""

    __name__ = "r_e"

    def score(self, texts: list[str], rows: list[dict[str, Any]], kwargs: Mapping[str, Any]) -> list[float | None]:
        from emrl_data.parser import ParseFailure, parse_report  # noqa: PLC0415

        sc, cfg = _scoring(), self._cfg()
        failures = []
        for text, row in zip(texts, rows, strict=True):
            parsed = parse_report(text, row["organ"])
            failures.append(str(getattr(parsed, "reason", parsed)) if isinstance(parsed, ParseFailure) else "")
        if "log_extra" in kwargs:
            kwargs["log_extra"]("parse_failure", failures)
        if "log_metric" in kwargs:
            kwargs["log_metric"]("parse_failure_rate", sum(bool(f) for f in failures) / max(1, len(failures)))
        return [float(sc.r_e(t, sc.truth_from_row(r), cfg)) for t, r in zip(texts, rows, strict=True)]


class FindingsReward(_Reward):
    """r_f: weighted attribute accuracy of the whole report; 1 on a true negative that claims no lesion (SPEC §7)."""

    __name__ = "r_f"

    def score(self, texts: list[str], rows: list[dict[str, Any]], kwargs: Mapping[str, Any]) -> list[float | None]:
        sc, cfg = _scoring(), self._cfg()
        return [float(sc.r_f(t, sc.truth_from_row(r), cfg)) for t, r in zip(texts, rows, strict=True)]


class ConsistencyReward(_Reward):
    """r_c: attribute accuracy of the verifier's text on frame k minus the K-Hit window penalty (SPEC §7).

    None on true negatives (as `emrl_data.scoring.r_c` returns). Logs the verifier text per completion.
    """

    __name__ = "r_c"

    def __init__(self, verifier: Verifier, scoring_config: Any = None):
        super().__init__(scoring_config)
        self.verifier = verifier

    def score(self, texts: list[str], rows: list[dict[str, Any]], kwargs: Mapping[str, Any]) -> list[float | None]:
        from train.data import frames_to_array  # noqa: PLC0415

        sc, cfg = _scoring(), self._cfg()
        if "frames" not in kwargs:
            raise KeyError("r_c needs the `frames` column to show the verifier the key frame.")
        stacks = [frames_to_array(f) for f in kwargs["frames"]]
        keys = [parse_key_slice(t, r["organ"], len(s))[0] for t, r, s in zip(texts, rows, stacks, strict=True)]
        # One query per completion on every rank (lockstep); no usable k -> the middle frame, text discarded.
        shown = [s[(k if k is not None else (len(s) + 1) // 2) - 1] for s, k in zip(stacks, keys, strict=True)]
        answers = self.verifier(shown)
        verifier_texts = [a if k is not None else "" for a, k in zip(answers, keys, strict=True)]
        if "log_extra" in kwargs:
            kwargs["log_extra"]("verifier", verifier_texts)
            kwargs["log_extra"]("verifier_frame", [k if k is not None else -1 for k in keys])
        out: list[float | None] = []
        for text, k, row in zip(verifier_texts, keys, rows, strict=True):
            value = sc.r_c(text, k, sc.truth_from_row(row), cfg)
            out.append(None if value is None else float(value))
        return out


def make_reward_funcs(
    names: Sequence[str], *, scoring_config: Any = None, verifier: Verifier | None = None
) -> list[Callable[..., list[float | None]]]:
    """Return the reward callables for an ablation: `["r_e"]`, `["r_e", "r_f"]` or `["r_e", "r_f", "r_c"]`.

    Args:
        names: reward names, a subset of `REWARD_NAMES` in any order (weights follow the same order).
        scoring_config: an `emrl_data.scoring.ScoringConfig`; its defaults when None.
        verifier: required when "r_c" is requested.

    Raises:
        ValueError: on an unknown or repeated name, or r_c without a verifier.
    """
    unknown = [n for n in names if n not in REWARD_NAMES]
    if unknown or len(set(names)) != len(names) or not names:
        raise ValueError(f"Invalid rewards {list(names)}; choose distinct names from {list(REWARD_NAMES)}.")
    funcs: list[Callable[..., list[float | None]]] = []
    for name in names:
        if name == "r_e":
            funcs.append(ExistenceReward(scoring_config))
        elif name == "r_f":
            funcs.append(FindingsReward(scoring_config))
        else:
            if verifier is None:
                raise ValueError("r_c needs a Verifier (the policy re-queried on the key frame).")
            funcs.append(ConsistencyReward(verifier, scoring_config))
    return funcs


def reward_weights_for(names: Sequence[str], weights: Mapping[str, float] | None = None) -> list[float]:
    """Return the weights of `names` in order (default SPEC §7: r_e 0.3, r_f 0.5, r_c 0.2; not renormalised)."""
    table = dict(DEFAULT_REWARD_WEIGHTS if weights is None else weights)
    return [float(table[n]) for n in names]
