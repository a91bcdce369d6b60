"""Tests of emrl_data.text.parser: template round trip, real AtlasAbdomen wording, paraphrases, malformed and adversarial text."""

from __future__ import annotations

import doctest
import itertools

import pytest

from emrl_data.reading.atlas import LOCATION_NAMES
from emrl_data.text import parser
from emrl_data.text.parser import ParsedReport, ParseFailure, parse_free_text, parse_report
from emrl_data.text.report import (
    format_location,
    render_evidence,
    render_findings,
    render_impression,
    render_report,
)
from emrl_data.types import Organ


NEGATIVE = ParsedReport(False, None, None, None, None, None, None, 0)


def _positive(
    long_cm: float | None = None,
    short_cm: float | None = None,
    location: tuple[str, ...] | None = None,
    attenuation: str | None = None,
    key_slice: int | None = None,
    bbox: tuple[int, int, int, int] | None = None,
    count: int | None = None,
) -> ParsedReport:
    return ParsedReport(True, long_cm, short_cm, location, attenuation, key_slice, bbox, count)


def _render(
    organ: Organ,
    location: tuple[str, ...],
    attenuation: str,
    count: int,
    long_mm: float,
    short_mm: float,
    evidence: tuple[int, tuple[int, int, int, int]] | None,
) -> str:
    findings = render_findings(
        organ,
        has_lesion=True,
        lesion_count=count,
        long_axis_mm=long_mm,
        short_axis_mm=short_mm,
        volume_mm3=5432.1,
        location=location,
        attenuation=attenuation,
    )
    impression = render_impression(
        organ, has_lesion=True, lesion_count=count, long_axis_mm=long_mm, location=location, attenuation=attenuation
    )
    return render_report(findings, impression, render_evidence(*evidence) if evidence else None)


def _all_template_cases() -> list[tuple[str, Organ, ParsedReport]]:
    """Every location subset x attenuation x count (1, >1) x sizes x with/without evidence, plus the negatives."""
    cases = []
    sizes = ((4.0, 3.0), (31.04, 22.0), (205.0, 150.5), (9.96, 9.94), (19.5, 5.0))
    for organ in Organ:
        names = LOCATION_NAMES[organ]
        subsets = [c for r in range(1, len(names) + 1) for c in itertools.combinations(names, r)]
        try:  # an empty location renders as the organ once report.py supports it
            format_location(organ, ())
            subsets.append(())
        except ValueError:
            pass
        for location, attenuation, count, (long_mm, short_mm), evidence in itertools.product(
            subsets,
            ("hypo", "iso", "hyper"),
            (1, 2, 17),
            sizes,
            (None, (12, (0, 5, 999, 1000)), (1, (10, 20, 30, 40))),
        ):
            text = _render(organ, location, attenuation, count, long_mm, short_mm, evidence)
            expected = _positive(
                round(long_mm / 10, 1),
                round(short_mm / 10, 1),
                location,
                attenuation,
                evidence[0] if evidence else None,
                evidence[1] if evidence else None,
                count,
            )
            cases.append((text, organ, expected))
        negative = render_report(
            render_findings(organ, has_lesion=False), render_impression(organ, has_lesion=False), None
        )
        cases.append((negative, organ, NEGATIVE))
    return cases


TEMPLATE_CASES = _all_template_cases()


def test_every_template_reads_back_exactly() -> None:
    wrong = [(text, got, want) for text, organ, want in TEMPLATE_CASES if (got := parse_report(text, organ)) != want]
    assert len(TEMPLATE_CASES) > 10_000
    assert wrong == []


@pytest.mark.slow
def test_template_fast_path_agrees_with_general_path() -> None:
    # The fast path must accept every template and give exactly what the general path gives.
    for text, organ, _ in TEMPLATE_CASES:
        lower = text.lower()
        fast = parser._parse_template(lower, organ)
        assert fast is not None, text
        assert fast == parser._parse_general(lower, organ), text


@pytest.mark.parametrize(
    "text",
    [
        # a different volume format and an extra space: general path only
        "<findings>A hypoattenuating lesion in hepatic segment 5/8 measures 3.1 x 2.2 cm  (volume 5.4 cc).</findings>"
        " || <impression>Hypoattenuating liver mass in hepatic segment 5/8, measuring 3.1 cm.</impression>",
        # a negative template followed by evidence tags
        "<findings>No focal liver lesion is identified.</findings> || <impression>No liver tumor.</impression> || "
        "The key lesion is in image <key_slice>3</key_slice>, <bbox>[1, 2, 3, 4]</bbox>",
    ],
)
def test_near_templates_fall_back_to_the_general_path(text: str) -> None:
    assert parser._parse_template(text.lower(), Organ.LIVER) is None
    assert isinstance(parse_report(text, Organ.LIVER), ParsedReport)


E = " || The key lesion is in image <key_slice>7</key_slice>, <bbox>[100, 200, 300, 400]</bbox>"
LIVER_T = "<findings>A hypoattenuating lesion in hepatic segment 5/8 measures 3.1 x 2.2 cm.</findings> || "
LIVER_I = "<impression>Hypoattenuating liver mass in hepatic segment 5/8, measuring 3.1 cm.</impression>"
LIVER_OK = _positive(3.1, 2.2, ("5", "8"), "hypo", 7, (100, 200, 300, 400), 1)


@pytest.mark.parametrize(
    ("text", "organ", "expected"),
    [
        # reference: our wording, parsed by the general path (no volume clause)
        (LIVER_T + LIVER_I + E, Organ.LIVER, LIVER_OK),
        # upper case and extra whitespace everywhere
        (
            "<FINDINGS>  A  HYPOATTENUATING lesion in Hepatic Segment 5/8\nmeasures 3.1 x 2.2 CM. </FINDINGS>||"
            "<Impression>Hypoattenuating liver mass.</Impression>  ||  The key lesion is in image "
            "<KEY_SLICE> 7 </KEY_SLICE>, <BBOX>[100,200, 300 ,400]</BBOX>",
            Organ.LIVER,
            LIVER_OK,
        ),
        # spaces inside the tags
        (
            "< findings >A hypoattenuating lesion in hepatic segment 5/8 measures 3.1 x 2.2 cm.</ findings > || "
            "< key_slice >7</ key_slice >, < bbox >[100, 200, 300, 400]</ bbox >",
            Organ.LIVER,
            LIVER_OK,
        ),
        # missing '||' separators
        (LIVER_T.replace(" || ", " ") + LIVER_I + E.replace(" || ", " "), Organ.LIVER, LIVER_OK),
        # unclosed findings tag: read up to the next tag
        (LIVER_T.replace("</findings>", "") + LIVER_I + E, Organ.LIVER, LIVER_OK),
        # unclosed impression and key_slice tags
        (
            LIVER_T + "<impression>Hypoattenuating liver mass. || The key lesion is in image <key_slice>7, "
            "<bbox>[100, 200, 300, 400]",
            Organ.LIVER,
            LIVER_OK,
        ),
        # closing findings tag without its opening tag
        (
            "A hypoattenuating lesion in hepatic segment 5/8 measures 3.1 x 2.2 cm.</findings> || " + LIVER_I + E,
            Organ.LIVER,
            LIVER_OK,
        ),
        # impression only (findings missing): attributes come from the impression
        (
            "<impression>Hypoattenuating liver mass in hepatic segment 5/8, measuring 3.1 cm.</impression>" + E,
            Organ.LIVER,
            _positive(3.1, None, ("5", "8"), "hypo", 7, (100, 200, 300, 400), None),
        ),
        # evidence without tags: the sentence form and Qwen's bbox_2d
        (
            LIVER_T + LIVER_I + ' || The key lesion is in image 7, {"bbox_2d": [100, 200, 300, 400]}',
            Organ.LIVER,
            LIVER_OK,
        ),
        # float box coordinates are rounded
        (LIVER_T + E.replace("[100, 200, 300, 400]", "[99.6, 200.2, 300, 400]"), Organ.LIVER, LIVER_OK),
        # paraphrase: hypodense, mm, roman numeral segment, "a ... mass"
        (
            "<findings>There is a 31 mm hypodense mass in segment VII of the liver.</findings>",
            Organ.LIVER,
            _positive(3.1, None, ("7",), "hypo", None, None, 1),
        ),
        # paraphrase: S-notation, range of segments, hyperenhancing, 3-cm
        (
            "<findings>A 3-cm hyperenhancing nodule spanning S5-S8.</findings>",
            Organ.LIVER,
            _positive(3.0, None, ("5", "6", "7", "8"), "hyper", None, None, 1),
        ),
        # paraphrase: caudate lobe, "low attenuation", short axis first
        (
            "<findings>Low attenuation lesion of the caudate lobe, 2.0 x 4.5 cm.</findings>",
            Organ.LIVER,
            _positive(4.5, 2.0, ("1",), "hypo", None, None, None),
        ),
        # segments written "2 and 3" (narrative wording); 4a -> 4
        (
            "<findings>A large isodense mass in hepatic segments 2, 3 and 4a, 10.2 x 6.5 cm.</findings>",
            Organ.LIVER,
            _positive(10.2, 6.5, ("2", "3", "4"), "iso", None, None, 1),
        ),
        # lesion placed in the organ without a sub-structure -> location ()
        (
            "<findings>A hypoattenuating lesion in the liver measures 3.1 x 2.2 cm.</findings>",
            Organ.LIVER,
            _positive(3.1, 2.2, (), "hypo", None, None, 1),
        ),
        # no location at all -> None
        (
            "<findings>A hypoattenuating lesion measures 3.1 x 2.2 cm.</findings>",
            Organ.LIVER,
            _positive(3.1, 2.2, None, "hypo", None, None, 1),
        ),
        # pancreas: "head of the pancreas", uncinate = head, "four lesions"
        (
            "<findings>Four pancreatic lesions; the largest is a hypoattenuating mass in the uncinate process and head "
            "of the pancreas, 2.5 cm.</findings>",
            Organ.PANCREAS,
            _positive(2.5, None, ("head",), "hypo", None, None, 4),
        ),
        # pancreas: body and tail
        (
            "<findings>A hyperattenuating lesion in pancreas body/tail measures 1.2 x 1.0 cm.</findings>",
            Organ.PANCREAS,
            _positive(1.2, 1.0, ("body", "tail"), "hyper", None, None, 1),
        ),
        # kidney: renal wording
        (
            "<findings>A 4 cm hypodense renal mass in the right kidney.</findings>",
            Organ.KIDNEY,
            _positive(4.0, None, ("right",), "hypo", None, None, 1),
        ),
        # kidney: bilateral -> both sides; "multiple" without a number -> count None
        (
            "<findings>Multiple bilateral hypoattenuating kidney lesions, the largest 2.2 x 2.0 cm.</findings>",
            Organ.KIDNEY,
            _positive(2.2, 2.0, ("left", "right"), "hypo", None, None, None),
        ),
        # negatives in other words
        ("<findings>The liver is unremarkable.</findings>", Organ.LIVER, NEGATIVE),
        ("<findings>No evidence of a focal hepatic mass.</findings>", Organ.LIVER, NEGATIVE),
        ("<findings>Pancreas without focal lesion.</findings>", Organ.PANCREAS, NEGATIVE),
        ("<findings>A renal mass is not seen.</findings>", Organ.KIDNEY, NEGATIVE),
        # naming the organ without a claim: negative by omission
        ("<findings>The pancreas is normal in size.</findings>", Organ.PANCREAS, NEGATIVE),
        # a denial of "other" lesions is not a denial of the lesion
        (
            "<findings>A 2 cm hypodense lesion in hepatic segment 6. No other lesions are seen.</findings>",
            Organ.LIVER,
            _positive(2.0, None, ("6",), "hypo", None, None, 1),
        ),
        # a sentence about another organ does not count for this one
        (
            "<findings>A 2 cm hypodense lesion in hepatic segment 6. The spleen is normal.</findings>",
            Organ.LIVER,
            _positive(2.0, None, ("6",), "hypo", None, None, 1),
        ),
        # volumes (cm^3, cc) are not sizes
        (
            "<findings>Liver volume 1291.3 cm^3. A hypoattenuating lesion in segment 2, volume 5.4 cc.</findings>",
            Organ.LIVER,
            _positive(None, None, ("2",), "hypo", None, None, 1),
        ),
    ],
)
def test_parse_report_table(text: str, organ: Organ, expected: ParsedReport) -> None:
    assert parse_report(text, organ) == expected


@pytest.mark.parametrize(
    ("text", "organ", "expected"),
    [
        # several <key_slice> tags -> key_slice None, the rest still counts
        (
            LIVER_T + LIVER_I + " || <key_slice>7</key_slice> <key_slice>8</key_slice>, <bbox>[1, 2, 3, 4]</bbox>",
            Organ.LIVER,
            _positive(3.1, 2.2, ("5", "8"), "hypo", None, (1, 2, 3, 4), 1),
        ),
        # several identical <key_slice> tags are still several tags
        (
            LIVER_T + LIVER_I + " || <key_slice>7</key_slice><key_slice>7</key_slice>",
            Organ.LIVER,
            _positive(3.1, 2.2, ("5", "8"), "hypo", None, None, 1),
        ),
        # several <bbox> tags -> bbox None
        (
            LIVER_T
            + LIVER_I
            + " || <key_slice>7</key_slice>, <bbox>[1, 2, 3, 4]</bbox><bbox>[0, 0, 1000, 1000]</bbox>",
            Organ.LIVER,
            _positive(3.1, 2.2, ("5", "8"), "hypo", 7, None, 1),
        ),
        # a bbox outside the 0-1000 grid -> None
        (
            LIVER_T + " <key_slice>7</key_slice>, <bbox>[100, 200, 1300, 400]</bbox>",
            Organ.LIVER,
            _positive(3.1, 2.2, ("5", "8"), "hypo", 7, None, 1),
        ),
        # a negative coordinate -> None
        (
            LIVER_T + " <key_slice>7</key_slice>, <bbox>[-5, 200, 300, 400]</bbox>",
            Organ.LIVER,
            _positive(3.1, 2.2, ("5", "8"), "hypo", 7, None, 1),
        ),
        # a degenerate bbox (x1 == x2) -> None
        (
            LIVER_T + " <key_slice>7</key_slice>, <bbox>[300, 200, 300, 400]</bbox>",
            Organ.LIVER,
            _positive(3.1, 2.2, ("5", "8"), "hypo", 7, None, 1),
        ),
        # an inverted bbox (y1 > y2) -> None; key slice 0 is not a frame -> None
        (
            LIVER_T + " <key_slice>0</key_slice>, <bbox>[100, 400, 300, 200]</bbox>",
            Organ.LIVER,
            _positive(3.1, 2.2, ("5", "8"), "hypo", None, None, 1),
        ),
        # a bbox with three numbers -> None
        (
            LIVER_T + " <key_slice>7</key_slice>, <bbox>[100, 200, 300]</bbox>",
            Organ.LIVER,
            _positive(3.1, 2.2, ("5", "8"), "hypo", 7, None, 1),
        ),
        # listing every segment is kept as the set (exact set match then fails unless it is the truth)
        (
            "<findings>A hypoattenuating lesion in hepatic segment 1/2/3/4/5/6/7/8 measures 3.1 x 2.2 cm.</findings>",
            Organ.LIVER,
            _positive(3.1, 2.2, ("1", "2", "3", "4", "5", "6", "7", "8"), "hypo", None, None, 1),
        ),
        # hedged segments with "or" -> location None
        (
            "<findings>A hypoattenuating lesion in hepatic segment 5 or 8 measures 3.1 x 2.2 cm.</findings>",
            Organ.LIVER,
            _positive(3.1, 2.2, None, "hypo", None, None, 1),
        ),
        # hedged pancreas part -> None
        (
            "<findings>A hypoattenuating lesion in the head or tail of the pancreas, 2 cm.</findings>",
            Organ.PANCREAS,
            _positive(2.0, None, None, "hypo", None, None, 1),
        ),
        # hedged kidney side -> None
        (
            "<findings>A hypoattenuating lesion in the left or right kidney, 2 cm.</findings>",
            Organ.KIDNEY,
            _positive(2.0, None, None, "hypo", None, None, 1),
        ),
        # every attenuation at once -> None
        (
            "<findings>A hypo-, iso- or hyperattenuating lesion in hepatic segment 5 measures 3 cm.</findings>",
            Organ.LIVER,
            _positive(3.0, None, ("5",), None, None, None, 1),
        ),
        # two attenuations in two findings sentences -> None
        (
            "<findings>A hypoattenuating lesion in hepatic segment 5 measures 3 cm. It is hyperdense.</findings>",
            Organ.LIVER,
            _positive(3.0, None, ("5",), None, None, None, 1),
        ),
        # a size range -> size None
        (
            "<findings>A hypoattenuating lesion in hepatic segment 5 measures 2-4 cm.</findings>",
            Organ.LIVER,
            _positive(None, None, ("5",), "hypo", None, None, 1),
        ),
        # alternative sizes -> size None
        (
            "<findings>A hypoattenuating lesion in hepatic segment 5 measures 1 cm or 3 cm.</findings>",
            Organ.LIVER,
            _positive(None, None, ("5",), "hypo", None, None, 1),
        ),
        # the findings win over a disagreeing impression (no double credit)
        (
            "<findings>A hypoattenuating lesion in hepatic segment 5 measures 3.1 x 2.2 cm.</findings> || "
            "<impression>Hyperattenuating liver mass in hepatic segment 8, measuring 9.9 cm.</impression>",
            Organ.LIVER,
            _positive(3.1, 2.2, ("5",), "hypo", None, None, 1),
        ),
        # a second <findings> tag is ignored
        (
            "<findings>No focal liver lesion is identified.</findings><findings>A 3 cm lesion in segment 5."
            "</findings> || <impression>No liver tumor.</impression>",
            Organ.LIVER,
            NEGATIVE,
        ),
    ],
)
def test_anti_gaming_table(text: str, organ: Organ, expected: ParsedReport) -> None:
    assert parse_report(text, organ) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty"),  # nothing
        ("   \n ", "empty"),  # whitespace
        ("<findings> </findings> || <impression></impression>", "empty"),  # empty sections
        ("I cannot tell.", "no_findings"),  # no section at all
        ("The key lesion is in image <key_slice>4</key_slice>", "no_findings"),  # evidence only
        # findings claim a lesion, impression says no tumor
        (LIVER_T + "<impression>No liver tumor.</impression>" + E, "contradiction"),
        # the reverse
        ("<findings>No focal liver lesion is identified.</findings> || " + LIVER_I, "contradiction"),
        # one section claiming and denying
        ("<findings>No focal liver lesion. A 3 cm hypodense mass in segment 5.</findings>", "contradiction"),
        # a section with no claim and no organ
        ("<findings>Image quality is good.</findings>", "undetermined"),
        # only another organ's lesion
        ("<findings>A 3 cm lesion in the left kidney.</findings>", "undetermined"),
    ],
)
def test_parse_failures(text: str, reason: str) -> None:
    assert parse_report(text, Organ.LIVER) == ParseFailure(reason)


STRUCTURED = (
    "CT Venous Phase\n\nFINDINGS:\nSpleen:\nNormal size (volume: 215.0 cm^3).\nMean HU value: 110.0 +/- 15.0.\n"
    "Liver:\nNormal size (volume: 1291.3 cm^3).\nMean HU value: 105.2 +/- 20.4.\nLiver lesions:\nLiver lesion 1:\n"
    "Location: hepatic segment 7/8.\nSize: 3.1 x 2.2 cm (image 123). Volume: 5.4 cm^3.\n"
    "Enhancement relative to liver: Hypoattenuating (HU value is 45.3+/-20.1).\nLiver lesion 2:\n"
    "Location: hepatic segment 2.\nSize: 1.1 x 0.9 cm (image 80). Volume: 0.4 cm^3.\n"
    "Enhancement relative to liver: Hyperattenuating (HU value is 145.3+/-20.1).\n"
    "Kidney:\nNormal size (right kidney volume: 150.1 cm^3; left kidney volume: 140.2 cm^3; total kidney volume: "
    "290.3 cm^3). Mean HU value: 150.0 +/- 3.0.\nKidney lesion 1:\nLocation: left kidney.\nSize: 1.5 x 1.1 cm "
    "(image 66). Volume: 1.2 cm^3.\nEnhancement relative to kidney: Hypoattenuating (HU value is 20.0+/-5.0).\n"
    "Pancreas:\nNormal size (volume: 72.1 cm^3).\n"
    "IMPRESSION:\nMultiple (25) hypoattenuating liver masses. Largest one (hepatic segment 7/8) measures 3.1 x 2.2 "
    "cm.\nTotal volume of all liver masses: 12.3 cm^3.\n"
)
NARRATIVE_3432 = (
    "FINDINGS:\n\nCHEST: \nNo significant findings are noted in the chest.\n\nABDOMEN:\nABDOMINAL ORGANS (INCLUDING "
    "BILIARY TREE): \nThe liver is normal in size, with a volume of 1481.0 cc. However, there are multiple "
    "hypoattenuating liver lesions identified. The largest lesion, located in hepatic segment 1, measures 2.7 x 2.0 "
    "cm (image 100) with a volume of 5.5 cc. Three additional smaller lesions are identified in hepatic segments 7, "
    "7/8, and 2, measuring 1.5 x 0.9 cm, 1.4 x 1.0 cm, and 1.2 x 0.9 cm, respectively. The spleen is normal in size, "
    "with a volume of 215.0 cc.\n\nThe pancreas is normal in size, with a volume of 72.1 cc. The kidneys are also "
    "normal in size, with a total volume of 283.7 cc. However, there are multiple hypoattenuating kidney lesions "
    "identified. The largest lesion, located in the left kidney, measures 1.5 x 1.1 cm (image 66) with a volume of "
    "1.2 cc. Two additional smaller lesions are identified in the right kidney, measuring 0.9 x 0.7 cm and 0.6 x 0.5 "
    "cm, respectively.\n\nIMPRESSION:\n1. Multiple (4) hypoattenuating liver masses, with the largest one measuring "
    "2.7 x 2.0 cm in hepatic segment 1.\n2. Multiple (3) hypoattenuating kidney masses, with the largest one "
    "measuring 1.5 x 1.1 cm in the left kidney."
)
NARRATIVE_3687 = (
    "FINDINGS: However, there are four liver lesions identified. The largest lesion is located in hepatic segments 2 "
    "and 3, measuring 10.2 x 6.5 cm, with a volume of 136.9 cc. This lesion is hypoattenuating, with a mean HU value "
    "of 13.7 +/- 30.9. A large hypoattenuating kidney lesion is present in the left kidney, measuring 5.2 x 4.4 cm, "
    "with a volume of 51.9 cc.\nIMPRESSION:\n1. A large hypoattenuating liver mass (10.2 x 6.5 cm) in hepatic "
    "segments 2 and 3, with three smaller hypoattenuating liver lesions.\n2. Enlarged kidneys with a large "
    "hypoattenuating kidney mass (5.2 x 4.4 cm) in the left kidney."
)


@pytest.mark.parametrize(
    ("text", "organ", "expected"),
    [
        # structured report: lesion 1 of the liver, not lesion 2; the count from the impression
        (STRUCTURED, Organ.LIVER, _positive(3.1, 2.2, ("7", "8"), "hypo", None, None, 25)),
        # structured report, kidney section: the kidney-volume line does not give a location
        (STRUCTURED, Organ.KIDNEY, _positive(1.5, 1.1, ("left",), "hypo", None, None, None)),
        # structured report, pancreas normal size -> negative
        (STRUCTURED, Organ.PANCREAS, NEGATIVE),
        # narrative: the largest liver lesion, not the "additional smaller" ones
        (NARRATIVE_3432, Organ.LIVER, _positive(2.7, 2.0, ("1",), "hypo", None, None, 4)),
        # narrative: kidney paragraph
        (NARRATIVE_3432, Organ.KIDNEY, _positive(1.5, 1.1, ("left",), "hypo", None, None, 3)),
        # narrative: the pancreas is only "normal in size"
        (NARRATIVE_3432, Organ.PANCREAS, NEGATIVE),
        # narrative: "hepatic segments 2 and 3", "four liver lesions"
        (NARRATIVE_3687, Organ.LIVER, _positive(10.2, 6.5, ("2", "3"), "hypo", None, None, 4)),
        # narrative: kidney lesion in a liver-led paragraph
        (NARRATIVE_3687, Organ.KIDNEY, _positive(5.2, 4.4, ("left",), "hypo", None, None, 1)),
        # RadGPT's all-negative impression
        ("FINDINGS: ...\nIMPRESSION:\nNo tumor observed in the liver, pancreas or kidneys.", Organ.KIDNEY, NEGATIVE),
    ],
)
def test_real_atlas_report_wording(text: str, organ: Organ, expected: ParsedReport) -> None:
    assert parse_report(text, organ) == expected


@pytest.mark.parametrize(
    ("text", "organ", "expected"),
    [
        # a verifier answer: paraphrase with roman numerals
        (
            "There is a 3 cm hypodense mass in segment VII.",
            Organ.LIVER,
            _positive(3.0, None, ("7",), "hypo", None, None, 1),
        ),
        # no lesion noun, but a measurement with a location and an attenuation
        (
            "Hypodense area, 25 mm, in S7/S8.",
            Organ.LIVER,
            _positive(2.5, None, ("7", "8"), "hypo", None, None, None),
        ),
        # a denial
        ("No abnormality is seen in this image.", Organ.LIVER, NEGATIVE),
        # the organ named without a claim
        ("This image shows the pancreas.", Organ.PANCREAS, NEGATIVE),
        # the verifier answering in the report format: tags become sentence breaks
        (
            "<findings>A hyperattenuating lesion in the right kidney</findings> 2.0 x 1.5 cm",
            Organ.KIDNEY,
            _positive(2.0, 1.5, ("right",), "hyper", None, None, 1),
        ),
    ],
)
def test_parse_free_text_table(text: str, organ: Organ, expected: ParsedReport) -> None:
    assert parse_free_text(text, organ) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty"),  # nothing
        ("I am not sure.", "undetermined"),  # neither claim nor organ
        ("No tumor. A 3 cm mass in segment 4.", "contradiction"),  # both claims
    ],
)
def test_parse_free_text_failures(text: str, reason: str) -> None:
    assert parse_free_text(text, Organ.LIVER) == ParseFailure(reason)


def test_organ_may_be_given_as_string() -> None:
    assert parse_report(LIVER_T + LIVER_I + E, "liver") == LIVER_OK


def test_docstring_examples() -> None:
    assert doctest.testmod(parser).failed == 0
