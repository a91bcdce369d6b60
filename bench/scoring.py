"""Parse + score throughput of `emrl_data.text.scoring.score_report` on one core (target >= 20,000 completions/s).

Builds a deterministic set of varied completions (exact templates of `emrl_data.text.report`, template variants with
malformed or adversarial parts, free paraphrases, garbage) with their truths, then times `score_report` over them,
single-threaded, best of `--repeat` runs. Prints completions/second per kind and overall, and the ratio to the target.

    python bench/scoring.py [--n 20000] [--repeat 3] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from emrl_data.reading.atlas import LOCATION_NAMES
from emrl_data.text.report import render_evidence, render_findings, render_impression, render_report
from emrl_data.text.scoring import Truth, score_report
from emrl_data.types import Organ


TARGET_PER_S = 20_000
ATTENUATIONS = ("hypo", "iso", "hyper")
PARAPHRASE_ATT = {"hypo": "hypodense", "iso": "isodense", "hyper": "hyperdense"}
ROMAN = ("i", "ii", "iii", "iv", "v", "vi", "vii", "viii")


def _random_truth(rng: random.Random) -> tuple[Truth, dict]:
    """Return a random truth and the label values used to render it."""
    organ = rng.choice(list(Organ))
    names = LOCATION_NAMES[organ]
    if rng.random() < 0.35:
        return Truth(organ, False, None, (), None, None), {}
    location = tuple(sorted(rng.sample(names, rng.randint(1, min(2, len(names)))), key=names.index))
    long_mm = rng.uniform(4.0, 120.0)
    labels = {
        "location": location,
        "attenuation": rng.choice(ATTENUATIONS),
        "long_axis_mm": long_mm,
        "short_axis_mm": long_mm * rng.uniform(0.4, 1.0),
        "volume_mm3": rng.uniform(50.0, 90_000.0),
        "lesion_count": rng.choice((1, 1, 1, 2, 3, 7)),
        "key_slice": rng.randint(1, 32),
        "bbox": sorted(rng.sample(range(1001), 2)) + sorted(rng.sample(range(1001), 2)),
    }
    truth = Truth(organ, True, round(long_mm / 10, 1), location, labels["attenuation"], labels["key_slice"])
    return truth, labels


def _template(truth: Truth, labels: dict, rng: random.Random) -> str:
    """Render a report exactly as `emrl_data.text.report` does, with labels perturbed like a model's answer."""
    if not truth.has_lesion and rng.random() < 0.8:
        organ = truth.organ
        return render_report(
            render_findings(organ, has_lesion=False), render_impression(organ, has_lesion=False), None
        )
    while not labels:  # a false positive on a negative row: describe some lesion
        _, labels = _random_truth(rng)
        labels = {**labels, "location": LOCATION_NAMES[truth.organ][:1]} if labels else labels
    long_mm = labels["long_axis_mm"] * rng.choice((1.0, 1.0, 1.3, 0.5))
    findings = render_findings(
        truth.organ,
        has_lesion=True,
        lesion_count=labels["lesion_count"],
        long_axis_mm=long_mm,
        short_axis_mm=min(long_mm, labels["short_axis_mm"]),
        volume_mm3=labels["volume_mm3"],
        location=labels["location"],
        attenuation=rng.choice((labels["attenuation"], labels["attenuation"], "iso")),
    )
    impression = render_impression(
        truth.organ,
        has_lesion=True,
        lesion_count=labels["lesion_count"],
        long_axis_mm=long_mm,
        location=labels["location"],
        attenuation=labels["attenuation"],
    )
    x1, x2, y1, y2 = labels["bbox"]
    evidence = render_evidence(labels["key_slice"] + rng.choice((0, 0, 1, -1, 5)), (x1, y1, x2 + 1, y2 + 1))
    return render_report(findings, impression, evidence)


def _variant(truth: Truth, labels: dict, rng: random.Random) -> str:
    """A template with a malformed or adversarial change."""
    text = _template(truth, labels, rng)
    change = rng.randrange(7)
    if change == 0:
        return text.upper().replace(" || ", "||  ")
    if change == 1:
        return text.replace("</findings>", "")
    if change == 2:
        return text + " <key_slice>3</key_slice>"
    if change == 3:
        return text.replace("<bbox>[", "<bbox>[1200, ")
    if change == 4:
        return text.replace("<impression>", "<impression>No tumor. ")
    if change == 5:
        return text.replace(" || ", " ")
    return text.replace("attenuating", "dense")


def _paraphrase(truth: Truth, labels: dict, rng: random.Random) -> str:
    """Free wording inside the tags."""
    organ = truth.organ
    if not labels:
        return rng.choice(
            (
                f"<findings>The {organ.value} is unremarkable.</findings> || <impression>Normal.</impression>",
                f"<findings>No evidence of a focal {organ.value} mass.</findings>",
                f"<findings>The {organ.value} is normal in size.</findings> || <impression>No tumor.</impression>",
            )
        )
    size = f"{labels['long_axis_mm']:.0f} mm" if rng.random() < 0.5 else f"{labels['long_axis_mm'] / 10:.1f} cm"
    if organ is Organ.LIVER:
        where = "segment " + " and ".join(ROMAN[int(n) - 1] for n in labels["location"])
    elif organ is Organ.PANCREAS:
        where = " and ".join(labels["location"]) + " of the pancreas"
    else:
        where = f"the {labels['location'][0]} kidney"
    return (
        f"<findings>There is a {size} {PARAPHRASE_ATT[labels['attenuation']]} mass in {where}. No other lesions."
        f"</findings> || <impression>{organ.value.capitalize()} tumor.</impression> || Key image "
        f"<key_slice>{labels['key_slice']}</key_slice> <bbox>[10, 10, 500, 500]</bbox>"
    )


def _garbage(truth: Truth, labels: dict, rng: random.Random) -> str:
    """Text a random model writes."""
    return rng.choice(
        (
            "",
            "I cannot determine this.",
            "<findings></findings>",
            "<findings>image image image <key_slice> 3 4</findings>",
            "lesion lesion " * rng.randint(1, 20),
            "<findings>" + "".join(rng.choice("abc <>/|.0123 ") for _ in range(rng.randint(10, 300))),
        )
    )


KINDS: dict[str, tuple[float, Callable[[Truth, dict, random.Random], str]]] = {
    "template": (0.55, _template),
    "variant": (0.20, _variant),
    "paraphrase": (0.15, _paraphrase),
    "garbage": (0.10, _garbage),
}
VERIFIER_TEXTS = (
    "There is a 3 cm hypodense mass in segment VII.",
    "No abnormality is seen.",
    "A hyperattenuating lesion in the left kidney measuring 2.1 x 1.5 cm.",
)


def build(n: int, seed: int) -> dict[str, list[tuple[str, Truth, str | None]]]:
    """Return {kind: [(completion, truth, verifier text or None)]}, n in all, deterministic for a seed."""
    rng = random.Random(seed)
    out: dict[str, list[tuple[str, Truth, str | None]]] = {kind: [] for kind in KINDS}
    for kind, (share, make) in KINDS.items():
        for _ in range(round(n * share)):
            truth, labels = _random_truth(rng)
            verifier = rng.choice(VERIFIER_TEXTS) if rng.random() < 0.25 else None
            out[kind].append((make(truth, labels, rng), truth, verifier))
    return out


def rate(items: list[tuple[str, Truth, str | None]], repeat: int) -> float:
    """Return completions per second of `score_report` over `items` (best of `repeat`)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for text, truth, verifier in items:
            score_report(text, truth, verifier_text=verifier)
        best = min(best, time.perf_counter() - start)
    return len(items) / best


def calibration_us(repeat: int = 200) -> float:
    """Return the best time of `sum(range(1000))` in microseconds: a machine-speed reference printed with the rates."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        sum(range(1000))
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def main() -> None:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=20_000, help="completions in all")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs; the best is reported")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"machine reference: sum(range(1000)) = {calibration_us():.1f} us (best of 200)")
    sets = build(args.n, args.seed)
    everything = [item for items in sets.values() for item in items]
    random.Random(args.seed).shuffle(everything)
    print(f"score_report over {len(everything)} completions, single core, best of {args.repeat}")
    print(f"{'kind':12s} {'n':>6s} {'per s':>10s} {'x target':>9s}")
    for kind, items in sets.items():
        per_s = rate(items, args.repeat)
        print(f"{kind:12s} {len(items):6d} {per_s:10.0f} {per_s / TARGET_PER_S:9.2f}")
    per_s = rate(everything, args.repeat)
    print(f"{'all (mixed)':12s} {len(everything):6d} {per_s:10.0f} {per_s / TARGET_PER_S:9.2f}")
    print(f"target {TARGET_PER_S}/s: {'met' if per_s >= TARGET_PER_S else 'NOT met'} ({per_s / TARGET_PER_S:.2f}x)")
    print(f"machine reference: sum(range(1000)) = {calibration_us():.1f} us (best of 200; compare runs across hosts)")


if __name__ == "__main__":
    main()
