"""E-MRL reward terms for TRL's GRPOTrainer, registered by name: r_e, r_f, r_c over `emrl_data.text.scoring` (docs/contract.md#scoring, docs/contract.md#training-recipe).

TRL calls each reward as `f(prompts=..., completions=..., completion_ids=..., **columns, trainer_state=...,
log_extra=..., log_metric=...)`, where `columns` are the dataset columns repeated per completion (`organ`, `has_lesion`,
`long_axis_mm`, `location`, `attenuation`, `key_slice_frame`, `frames`, ...). Each returns `list[float | None]`;
None (r_c on a true negative) is excluded by TRL.

* A reward term is registered under a name with `@reward_term(name)` (`REWARD_TERMS`): a plain function of the
  completions and the dataset's columns, or with `factory=True` a function of `RewardOptions` that builds the callable
  (a term that holds state). The GRPO config names its terms (`rewards: [r_e, r_f, r_c]`, an entry `name=weight`
  sets a weight; `package.module.name` imports the module that registers `name`); `make_reward_funcs` builds them and
  `reward_weights_for` weighs them.
* `r_e`, `r_f` are plain functions; each parses every completion once per call.
* `ConsistencyReward` (r_c) is the one class: it holds the verifier. The verifier re-queries the **current policy**
  with the verifier prompt on the predicted key frame alone, through the trainer's own generation backend
  (`VideoGRPOTrainer._generate_single_turn`: HF generate under ZeRO-3 gathering, or vLLM with this step's weights).
  It runs only where `scoring.verifier_frame` names a frame (not on true negatives under `negative_rows="skip"`,
  not on completions without a usable key frame), once per distinct (row, k) in the call; every value is
  `scoring.consistency_reward`, the r_c of mining and evaluation. Under several processes a rank with no query still
  makes one (discarded) call, so the collectives inside generation stay in lockstep.
* The weights of the terms of the score R (`SCORE_TERMS`: r_e, r_f, r_c), λ and the r_c options come from
  `emrl_data.text.scoring.ScoringConfig`, the one table. A term outside R is training-only: the config gives its
  weight, and it changes GRPO's reward list, never the score.
* The score that mines hard cases and evaluates a model is its own function, `emrl_data.text.scoring.score_report`
  (R = `scoring.total_reward` of r_e, r_f, r_c); this module's registry does not reach it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import math
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from emrl_data.text import scoring as sc
from emrl_data.text.parser import parse_report
from emrl_data.text.report import VERIFIER_PROMPT


logger = logging.getLogger(__name__)

TRUTH_KEYS = sc.TRUTH_COLUMNS  # the truth columns a report is scored against, named once in emrl_data.text.scoring
SCORE_TERMS = sc.REWARD_NAMES  # the terms of the score R, weighted by ScoringConfig
REWARD_NAMES = SCORE_TERMS  # GRPO's default reward list: R's terms
DEFAULT_REWARD_WEIGHTS = sc.DEFAULT_CONFIG.reward_weight_table()  # derived from ScoringConfig, never typed here

RewardFunc = Callable[..., Sequence[float | None]]
_F = TypeVar("_F", bound=Callable[..., Any])
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class RewardOptions:
    """What a term built by a factory may read besides the rows (`reward_term(..., factory=True)`).

    Attributes:
        scoring_config: the score table and the r_c options; None: `ScoringConfig()`.
        verifier: the policy re-queried on a key frame (r_c); None where no term queries it.
        seed: the run's seed (r_c's `cross_view="random_frame"` draw).
    """

    scoring_config: sc.ScoringConfig | None = None
    verifier: Verifier | None = None
    seed: int = 0


@dataclass(frozen=True)
class RewardTerm:
    """A registered reward term: `build(options)` returns the callable TRL calls, named `name`."""

    name: str
    source: Any  # the decorated function
    build: Callable[[RewardOptions], RewardFunc]


REWARD_TERMS: dict[str, RewardTerm] = {}  # name -> term, filled by `@reward_term`


def reward_term(name: str, *, factory: bool = False) -> Callable[[_F], _F]:
    """Register a reward term under `name`; returns the decorated function unchanged.

    Without `factory` the function is the reward, TRL's convention `f(completions, **columns) -> list[float | None]`
    (it also gets `scoring_config=` when its signature names it and the run sets one). With `factory=True` it is
    `make(options: RewardOptions) -> reward callable`, for a term that holds state (r_c holds the verifier).

        @reward_term("r_len")
        def r_len(completions, **columns):
            return [min(1.0, len(completion_text(c)) / 400) for c in completions]

    Raises:
        ValueError: on a name that is not an identifier, or one another function already holds.
    """
    if not _NAME.fullmatch(name):
        raise ValueError(f"Reward term name {name!r} must be an identifier (letters, digits, _).")

    def register(func: _F) -> _F:
        held = REWARD_TERMS.get(name)
        if held is not None and _qualname(held.source) != _qualname(func):  # a module imported again re-registers
            raise ValueError(
                f"Reward term {name!r} is registered twice: {_qualname(held.source)} and {_qualname(func)}."
            )
        build = func if factory else functools.partial(_plain_term, func, name)
        REWARD_TERMS[name] = RewardTerm(name, func, build)
        return func

    return register


def _qualname(func: Any) -> str:
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"


def _plain_term(func: Callable[..., Any], name: str, options: RewardOptions) -> RewardFunc:
    """The callable of a plain term: `func` itself, or a copy bound to the run's `scoring_config`, named `name`."""
    bound: Any = func
    if options.scoring_config is not None and "scoring_config" in inspect.signature(func).parameters:
        bound = functools.partial(func, scoring_config=options.scoring_config)
    if bound is func and getattr(func, "__name__", None) == name:
        return func
    if bound is func:
        bound = functools.partial(func)
    wrapped = functools.update_wrapper(bound, func)
    wrapped.__name__ = name  # TRL logs `rewards/<__name__>/mean`
    return wrapped


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


def _scores(completions: Sequence[Any], kwargs: Mapping[str, Any], cfg: sc.ScoringConfig | None):
    """Return (texts, truths, scores): every completion parsed once (`scoring.score_report`)."""
    cfg = cfg or sc.DEFAULT_CONFIG
    texts = [completion_text(c) for c in completions]
    truths = [sc.truth_from_row(r) for r in truth_rows(kwargs, len(texts))]
    return texts, truths, [sc.score_report(t, tr, cfg=cfg) for t, tr in zip(texts, truths, strict=True)]


@reward_term("r_e")
def r_e(completions: Sequence[Any], scoring_config: sc.ScoringConfig | None = None, **kwargs: Any) -> list[float]:
    """r_e: 1 when the report's lesion claim matches the truth, else 0 (docs/contract.md#scoring). Logs parse failures."""
    _, _, scores = _scores(completions, kwargs, scoring_config)
    failures = [s.parse_failure or "" for s in scores]
    if "log_extra" in kwargs:
        kwargs["log_extra"]("parse_failure", failures)
    if "log_metric" in kwargs:
        kwargs["log_metric"]("parse_failure_rate", sum(bool(f) for f in failures) / max(1, len(failures)))
    return [float(s.r_e) for s in scores]


@reward_term("r_f")
def r_f(completions: Sequence[Any], scoring_config: sc.ScoringConfig | None = None, **kwargs: Any) -> list[float]:
    """r_f: weighted attribute accuracy of the whole report; 1 on a true negative that claims no lesion (docs/contract.md#scoring)."""
    _, _, scores = _scores(completions, kwargs, scoring_config)
    return [float(s.r_f) for s in scores]


box_iou = sc.box_iou  # kept importable here; the box term is part of `scoring.consistency_reward`


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
        self.n_calls = 0  # generation calls (at most one per reward call)
        self.n_queries = 0  # verifier prompts answered (one per distinct (row, k) with a usable k)

    def __call__(self, frames: Sequence[Any]) -> list[str]:
        """Return one verifier text per frame.

        Args:
            frames: one key frame per completion, each `(H, W)` uint8 or a PIL image.
        """
        # lazy: train.data loads transformers: +6.7 s to importing this module (measured)
        from train.data import verifier_messages

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

    def idle_call(self) -> list[str]:
        """Keep ranks in lockstep when this rank has no query: one discarded query under several processes.

        Generation gathers sharded weights (ZeRO-3) collectively, so every rank must call it equally often; a single
        process skips the call. Returns [] (no answers).
        """
        n_proc = getattr(getattr(self.trainer, "accelerator", None), "num_processes", 1)
        if n_proc > 1:
            self([np.zeros((32, 32), dtype=np.uint8)])
            self.n_queries -= 1  # not an answered query
        return []


class ConsistencyReward:
    """r_c as TRL calls it: `scoring.consistency_reward` per completion, with the verifier's answers (docs/contract.md#scoring).

    The frame each completion needs described is `scoring.verifier_frame` (None: no query, e.g. a parse failure or a
    true negative under `negative_rows="skip"`); every value is `scoring.consistency_reward`, the function mining and
    evaluation call, so the three agree. Identical (row, k) queries in one call are answered once; each row's frames
    are decoded once per call. `cross_view` (of the `ScoringConfig`):

    * `full`: the verifier is shown frame k of the completion's own row.
    * `distance_only`: no verifier call at all (not even the idle one); `verifier` may be None.
    * `random_frame`: the verifier is shown frame min(k, N') of another row of the call (a row of another case when
      the call holds one), drawn with `random.Random(f"{seed}:{call}")` in query order: deterministic for a seed and
      a sequence of calls. A call holding a single row raises (`train.grpo` refuses such a batch up front).

    Logs the verifier text, the frame shown (`verifier_frame`, -1 = none) and the completion whose row it came from
    (`verifier_row`, -1 = none) per completion.
    """

    __name__ = "r_c"

    def __init__(self, verifier: Verifier | None, scoring_config: sc.ScoringConfig | None = None, seed: int = 0):
        self.verifier = verifier
        self.scoring_config = scoring_config or sc.DEFAULT_CONFIG
        self.seed = seed
        self.n_reward_calls = 0
        if verifier is None and self.scoring_config.cross_view != "distance_only":
            raise ValueError(
                "r_c needs a Verifier (the policy re-queried on the key frame) unless cross_view=distance_only."
            )

    def __call__(self, prompts: Any = None, completions: Any = None, **kwargs: Any) -> list[float | None]:
        """Return r_c per completion (TRL's reward signature)."""
        if "frames" not in kwargs:
            raise KeyError("r_c needs the `frames` column to show the verifier the key frame.")
        cfg = self.scoring_config
        texts = [completion_text(c) for c in completions]
        truths = [sc.truth_from_row(r) for r in truth_rows(kwargs, len(texts))]
        preds = [parse_report(t, tr.organ) for t, tr in zip(texts, truths, strict=True)]
        n_frames = [_n_frames(kwargs, i) for i in range(len(texts))]
        keys = [sc.verifier_frame(p, tr, cfg, n) for p, tr, n in zip(preds, truths, n_frames, strict=True)]
        answers, shown_from = self._answers(keys, n_frames, kwargs)
        self.n_reward_calls += 1
        if "log_extra" in kwargs:
            kwargs["log_extra"]("verifier", [a if a is not None else "" for a in answers])
            kwargs["log_extra"]("verifier_frame", [f[1] if f is not None else -1 for f in shown_from])
            kwargs["log_extra"]("verifier_row", [f[0] if f is not None else -1 for f in shown_from])
        return [
            sc.consistency_reward(p, tr, a, cfg, n_frames=n, truth_bbox=_column(kwargs, "bbox_qwen", i))
            for i, (p, tr, a, n) in enumerate(zip(preds, truths, answers, n_frames, strict=True))
        ]

    def _answers(
        self, keys: list[int | None], n_frames: list[int], kwargs: Mapping[str, Any]
    ) -> tuple[list[str | None], list[tuple[int, int] | None]]:
        """Query the verifier once per distinct (row, k); return per completion its answer and (completion, frame) shown."""
        from train.data import frames_to_array  # lazy: train.data: +6.7 s (see Verifier.__call__)

        if self.scoring_config.cross_view == "distance_only":
            return [None] * len(keys), [None] * len(keys)
        rows = [_row_key(kwargs, i) for i in range(len(keys))]
        first: dict[Any, int] = {}  # row -> its first completion, in order of appearance
        for i, row in enumerate(rows):
            first.setdefault(row, i)
        rng = random.Random(f"{self.seed}:{self.n_reward_calls}")
        queries: dict[tuple[Any, int], int] = {}  # (row, k) -> query index
        sources: list[tuple[int, int]] = []  # per query: (completion whose frames are shown, frame 1-based)
        for i, k in enumerate(keys):
            if k is not None and (rows[i], k) not in queries:
                queries[(rows[i], k)] = len(sources)
                sources.append(self._source(i, k, rows, first, n_frames, kwargs, rng))
        stacks: dict[int, Any] = {}
        shown = []
        for j, frame in sources:
            if j not in stacks:
                stacks[j] = frames_to_array(kwargs["frames"][j])
            shown.append(stacks[j][frame - 1])
        if self.verifier is None:  # only distance_only builds without one (returned above)
            raise RuntimeError("r_c has no verifier.")
        texts = self.verifier(shown) if shown else self.verifier.idle_call()
        if "log_metric" in kwargs:
            kwargs["log_metric"]("verifier_queries", float(len(shown)))
        picked = [queries[(rows[i], k)] if k is not None else None for i, k in enumerate(keys)]
        return [texts[q] if q is not None else None for q in picked], [
            sources[q] if q is not None else None for q in picked
        ]

    def _source(
        self,
        i: int,
        k: int,
        rows: list[Any],
        first: dict[Any, int],
        n_frames: list[int],
        kwargs: Mapping[str, Any],
        rng: random.Random,
    ) -> tuple[int, int]:
        """Return (completion, frame) whose image the verifier sees for completion i's frame k."""
        if self.scoring_config.cross_view != "random_frame":
            return first[rows[i]], k
        others = [j for row, j in first.items() if row != rows[i]]
        if "case_id" in kwargs:
            other_cases = [j for j in others if kwargs["case_id"][j] != kwargs["case_id"][i]]
            others = other_cases or others
        if not others:
            raise ValueError(
                "cross_view=random_frame: this r_c call holds a single row, so no other row's frame can be shown; "
                "give each generation batch >= 2 prompts (per_device_train_batch_size x steps_per_generation >= "
                "2 x num_generations)."
            )
        j = rng.choice(others)
        return j, min(k, n_frames[j])


def _column(kwargs: Mapping[str, Any], name: str, i: int) -> Any:
    """Return column `name` of completion i, or None when the dataset has no such column."""
    values = kwargs.get(name)
    return None if values is None else values[i]


def _n_frames(kwargs: Mapping[str, Any], i: int) -> int:
    """Return the frame count of completion i's row (`n_frames` column, else the length of `frames`)."""
    n = _column(kwargs, "n_frames", i)
    return int(n) if n is not None else len(kwargs["frames"][i])


def _row_key(kwargs: Mapping[str, Any], i: int) -> Any:
    """Return an identity of completion i's row: (case_id, organ) when present, else the frames object."""
    if "case_id" in kwargs and "organ" in kwargs:
        return (kwargs["case_id"][i], kwargs["organ"][i])
    return id(kwargs["frames"][i])


@reward_term("r_c", factory=True)
def _consistency_term(options: RewardOptions) -> ConsistencyReward:
    """r_c: `ConsistencyReward` with the run's verifier, scoring config and seed."""
    return ConsistencyReward(options.verifier, options.scoring_config, seed=options.seed)


RewardEntry = str | Mapping[str, float]  # a config entry: "name", "name=weight" or {name: weight}


def parse_reward_entry(entry: RewardEntry) -> tuple[str, float | None]:
    """Return (name, weight) of a config entry (`"r_e"`, `"r_len=0.1"`, `{"r_len": 0.1}`); weight None when not given.

    Raises:
        ValueError: on an entry of another shape or a weight that is not a finite number.
    """
    raw: Any
    if isinstance(entry, Mapping):
        if len(entry) != 1:
            raise ValueError(f"Reward entry {dict(entry)} must name one term: {{name: weight}}.")
        ((name, raw),) = entry.items()
    elif isinstance(entry, str):
        name, _, text = entry.partition("=")
        raw = text.strip() or None
    else:
        raise ValueError(f"Reward entry {entry!r} must be a name, name=weight or {{name: weight}}.")
    name = str(name).strip()
    if raw is None:
        return name, None
    try:
        weight = float(raw)
    except (TypeError, ValueError):
        weight = math.nan
    if not math.isfinite(weight):
        raise ValueError(f"Reward entry {entry!r}: the weight {raw!r} is not a finite number.")
    return name, weight


def registered_term(name: str) -> RewardTerm:
    """Return the term registered as `name`; `package.module.name` imports `package.module` first (it registers it).

    Raises:
        ValueError: one line naming the unknown term and the registered ones.
    """
    module, dot, short = name.rpartition(".")
    if dot:  # the module registers `short` when imported (once: Python caches it)
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ValueError(f"Reward term {name!r}: cannot import {module!r} ({exc}).") from None
    term = REWARD_TERMS.get(short)
    if term is None:
        raise ValueError(
            f"Unknown reward term {name!r}; registered: {', '.join(sorted(REWARD_TERMS))} (a term of another module: "
            "package.module.name, where the module registers it with @train.rewards.reward_term)."
        )
    return term


def check_reward_entries(entries: Sequence[RewardEntry]) -> list[tuple[str, float | None]]:
    """Return (registered name, weight) per config entry, after checking them as a whole.

    Raises:
        ValueError: one line, on an empty list, a malformed entry, an unknown or repeated term, or a training-only
            term (outside `SCORE_TERMS`) without a weight.
    """
    named = _checked(entries)
    unweighted = [n for n, w in named if w is None and n not in SCORE_TERMS]
    if unweighted:
        raise ValueError(
            f"Reward term(s) {unweighted} are outside the score R ({', '.join(SCORE_TERMS)}), so ScoringConfig holds no "
            f"weight for them; give one in the config, e.g. {unweighted[0]}=0.1."
        )
    return named


def make_reward_funcs(
    names: Sequence[RewardEntry],
    *,
    scoring_config: sc.ScoringConfig | None = None,
    verifier: Verifier | None = None,
    seed: int = 0,
) -> list[RewardFunc]:
    """Return GRPO's reward callables, one per entry in order, each named as its term (`rewards/<name>/mean` in TRL's log).

    Args:
        names: config entries of registered terms (`REWARD_TERMS`): `"r_e"`, `"r_len=0.1"` (the weight is read by
            `reward_weights_for`), `"package.module.r_len=0.1"`; the ablations `["r_e"]`, `["r_e", "r_f"]`,
            `["r_e", "r_f", "r_c"]`.
        scoring_config: an `emrl_data.text.scoring.ScoringConfig` (weights, λ and the r_c options `negative_rows`,
            `cross_view`); its defaults when None.
        verifier: required when "r_c" is requested, except under `cross_view="distance_only"`.
        seed: the draw of `cross_view="random_frame"`.

    Raises:
        ValueError: on an unknown or repeated name, or r_c without a verifier.
    """
    options = RewardOptions(scoring_config=scoring_config, verifier=verifier, seed=seed)
    return [REWARD_TERMS[name].build(options) for name, _ in _checked(names)]


def _checked(entries: Sequence[RewardEntry]) -> list[tuple[str, float | None]]:
    """`check_reward_entries` without the weight rule (weights are `reward_weights_for`'s)."""
    parsed = [parse_reward_entry(e) for e in entries]
    named = [(registered_term(n).name, w) for n, w in parsed]
    names = [n for n, _ in named]
    if not names or len(set(names)) != len(names):
        raise ValueError(
            f"Invalid rewards {list(entries)}; name distinct terms from {', '.join(sorted(REWARD_TERMS))}."
        )
    return named


def weighable(entry: RewardEntry) -> bool:
    """Whether an entry's weight is known without the trainer: it gives one, or it is a term of the score R."""
    try:
        name, weight = parse_reward_entry(entry)
    except ValueError:
        return False
    return weight is not None or name.rpartition(".")[2] in SCORE_TERMS


def reward_weights_for(
    names: Sequence[RewardEntry],
    weights: Sequence[float] | None = None,
    scoring_config: sc.ScoringConfig | None = None,
) -> list[float]:
    """Return the weights of `names` in order (not renormalised): the entry's own (`"r_len=0.1"`), else
    `ScoringConfig.reward_weights` for a term of the score R.

    Args:
        names: reward entries (`make_reward_funcs`).
        weights: explicit weights (e.g. TRL's `reward_weights` in a config); must have one weight per name.
        scoring_config: the table to read; `ScoringConfig()` when None.

    Raises:
        ValueError: when `weights` has the wrong length (it is never silently replaced), or a training-only term has
            no weight.
    """
    if weights is not None:
        if len(weights) != len(names):
            raise ValueError(
                f"reward_weights={list(weights)} has {len(weights)} weights for the {len(names)} rewards {list(names)}; "
                "give one weight per reward or drop reward_weights to use ScoringConfig's table."
            )
        return [float(w) for w in weights]
    table = (scoring_config or sc.DEFAULT_CONFIG).reward_weight_table()
    out = []
    for entry in names:
        name, weight = parse_reward_entry(entry)
        short = name.rpartition(".")[2]
        if weight is None and short not in table:
            raise ValueError(f"Reward term {name!r} is outside the score R, so it needs a weight: {name}=<weight>.")
        out.append(float(table[short]) if weight is None else weight)
    return out
