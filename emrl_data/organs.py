"""The organ registry: everything the pipeline knows about one organ, in one entry (docs/contract.md#input, #labels, #report-format, #scoring).

An `OrganSpec` holds an organ's mask files, its sub-structures and location vocabulary, its report wording, the words
the parser reads, its metadata-CSV columns and its synthetic anatomy. `atlas`, `labels`, `report`, `parser`,
`synthetic`, `records`, `card`, `curate` and `train.tiny.synthetic` look values up here; none of them branches on a particular
organ.

Adding an organ is one `register_organ(OrganSpec(...))` call (a permanent one goes in `_BUILT_IN` below); its
`anatomy` field (an `OrganAnatomy`: HU, ellipsoids, sub-structure regions) is how the synthetic atlas
(`emrl_data.synthetic`) and the synthetic training rows (`train.tiny.synthetic`) draw it. `tests/emrl_data/test_organs.py`
registers a spleen and runs the synthetic pipeline end to end for it; `tests/test_architecture.py` checks that no other
module names an organ (what a synthetic defect breaks is the entry's `anatomy.defect_files` too).

`Organ` is the name of a registered organ. It behaves like a `StrEnum`: `Organ("liver") is Organ.LIVER`,
`for organ in Organ` lists the registered organs in registration order (the row order of every table), and an organ
compares, hashes and serialises as its name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, TypeVar


__all__ = [
    "LOCATION_NAMES",
    "METADATA_COLUMNS",
    "ORGANS",
    "ORGAN_STRUCTURES",
    "CsvColumns",
    "Ellipsoid",
    "Organ",
    "OrganAnatomy",
    "OrganSpec",
    "OrganTable",
    "PartRegion",
    "PLAUSIBLE_ORGAN_VOLUME_CM3",
    "defect_files",
    "organ_spec",
    "register_organ",
    "registry_version",
    "side_locations",
    "unregister_organ",
]

T = TypeVar("T")


class _OrganType(type):
    """Metaclass of `Organ`: iterating the class lists the registered organs, as iterating an enum would."""

    def __iter__(cls) -> Iterator[Organ]:
        return iter(tuple(_MEMBERS.values()))

    def __len__(cls) -> int:
        return len(_MEMBERS)

    def __contains__(cls, value: object) -> bool:
        return isinstance(value, str) and str(value) in _MEMBERS


class Organ(str, metaclass=_OrganType):
    """The name of a registered organ (one organ row per case). `Organ("spleen")` raises until spleen is registered."""

    __slots__ = ()

    LIVER: ClassVar[Organ]
    PANCREAS: ClassVar[Organ]
    KIDNEY: ClassVar[Organ]

    def __new__(cls, value: str) -> Organ:
        try:
            return _MEMBERS[str(value)]
        except KeyError:
            raise ValueError(f"{value!r} is not a registered organ; registered: {list(_MEMBERS)}.") from None

    @property
    def value(self) -> str:
        """The organ's name, as in the tables ("liver")."""
        return str.__str__(self)

    @property
    def name(self) -> str:
        """The constant's name ("LIVER")."""
        return self.value.upper()

    def __str__(self) -> str:
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"<Organ.{self.name}: {self.value!r}>"

    def __reduce__(self) -> tuple[Any, ...]:
        return Organ, (self.value,)

    def __copy__(self) -> Organ:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Organ:
        return self


@dataclass(frozen=True, slots=True)
class CsvColumns:
    """Column names of one organ in the atlas metadata CSV (`AbdomenAtlas3.0MiniWithMeta.csv`, docs/contract.md#input)."""

    count: str
    diameter_cm: str
    location: str
    attenuation: str
    organ_volume_cm3: str

    @classmethod
    def atlas(cls, lesion_word: str, volume_word: str, location_hint: str) -> CsvColumns:
        """Return the names as AbdomenAtlas 3.0 spells them, e.g. `atlas("pancreatic", "pancreas", "head, body, tail")`."""
        attenuation = "attenuation (hyperattenuating, isoattenuating, hypoattenuating)"
        return cls(
            count=f"number of {lesion_word} lesion instances",
            diameter_cm=f"largest {lesion_word} lesion diameter (cm)",
            location=f"largest {lesion_word} lesion location ({location_hint})",
            attenuation=f"largest {lesion_word} lesion {attenuation}",
            organ_volume_cm3=f"{volume_word} volume (cm^3)",
        )

    def as_dict(self) -> dict[str, str]:
        """Return key -> column name (keys: count, diameter_cm, location, attenuation, organ_volume_cm3)."""
        return asdict(self)


# An ellipsoid in body units: (centre (u, v, w), semi-axes (u, v, w)); u = x / A, v = y / B (A, B: the body's semi-axes),
# w = z / half the z field of view; u grows towards the patient's right, v anterior, w superior (`emrl_data.synthetic`).
Ellipsoid = tuple[tuple[float, float, float], tuple[float, float, float]]
_ANY = (-math.inf, math.inf)


@dataclass(frozen=True, slots=True, kw_only=True)
class PartRegion:
    """One sub-structure file of a synthetic organ: the organ's voxels whose coordinates lie in a box.

    The coordinates are normalised to the ellipsoid of the organ's first mask file (`OrganSpec.organ_masks[0]`):
    (u, v, w) = (voxel - centre) / semi-axes, u towards the patient's right, v anterior, w superior. Each bound is a
    half-open range `[low, high)`; the regions of an organ should partition it (a voxel in none is in no part).

    Attributes:
        file: the sub-structure file (a file of `OrganSpec.parts`, e.g. "liver_segment_7").
        u, v, w: the ranges of the normalised coordinates; default: unbounded.
    """

    file: str
    u: tuple[float, float] = _ANY
    v: tuple[float, float] = _ANY
    w: tuple[float, float] = _ANY


@dataclass(frozen=True, slots=True, kw_only=True)
class OrganAnatomy:
    """How synthetic data draws one organ: the atlas phantom (`emrl_data.synthetic`), training rows (`train.tiny.synthetic`).

    Attributes:
        hu: parenchyma HU.
        shapes: organ mask file -> its `Ellipsoid` in body units, for every file of `OrganSpec.organ_masks`. Organs
            must not overlap each other (they are painted in registration order).
        parts: the regions that draw the sub-structure files inside the organ's first mask file; () when the organ
            has no sub-structures or its mask files are its parts (the kidney sides).
        side_locations: the location a synthetic training row names for a lesion drawn on the image's left / right
            half (`train.tiny.synthetic`); None: the organ's first / last location name (`side_locations`).
        defect_files: the synthetic atlas' defects and quirks (`emrl_data.synthetic.specs`: `DEFECTS`, `QUIRKS`)
            that act on one of this organ's files, each with that file's stem (an organ mask or the lesion mask;
            `bad_metadata_row` breaks the organ's metadata-CSV count instead). Each belongs to one organ.
    """

    hu: int
    shapes: tuple[tuple[str, Ellipsoid], ...]
    parts: tuple[PartRegion, ...] = ()
    side_locations: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    defect_files: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class OrganSpec:
    """Everything the pipeline knows about one organ.

    Attributes:
        name: the organ's name in the tables ("liver").
        organ_masks: mask files (stems, as released) whose union is the organ (both kidneys for "kidney").
        lesion_mask: the organ's lesion file; an absent file with a present organ means "no lesion" (unless
            `lesion_fallbacks` exist).
        lesion_aliases: other names of the lesion file (RadGPT's `hepatic_*`/`renal_*` aliases), tried in order
            after `lesion_mask`.
        lesion_fallbacks: used only when no lesion file exists: their union is the lesion mask (the AbdomenAtlas
            3.0 class map's `*_tumor`/`*_cyst` (+ pancreatic `pdac`/`pnet`) files, docs/contract.md#input).
        lesion_prefixes: file-name prefixes of the organ, for spotting unrecognised lesion-like files.
        parts: sub-structure file -> location name, in report order; () for an organ without sub-structures.
        single_location: keep only the part holding most of the lesion (kidney: one side; ties -> the first part).
        display: the organ in the prompt ("the kidneys").
        adjective: the organ in report sentences ("pancreatic lesion", "No kidney tumor.").
        location_phrase: where a lesion is, "{}" standing for the location names joined by "/"
            ("hepatic segment {}" -> "hepatic segment 5/8").
        whole_organ_phrase: where a lesion in no sub-structure is ("the liver").
        mentions: substrings that make a sentence about this organ ("hepat" covers "hepatic").
        mention_pattern: a regex that also does ("(?<!ad)renal": renal but not adrenal); None for none.
        words: whole words naming the organ (a sentence naming only other organs is dropped for this one).
        word_prefixes: word beginnings that do the same ("nephr").
        in_organ_nouns: regex alternatives for "a lesion in the <noun>" (placed in the organ, no sub-structure).
        negation_modifiers: words allowed between "no" and "lesion" in a denial ("no focal hepatic lesion").
        location_reader: how the parser reads locations: "words" (`location_words`) or "couinaud" (liver segments
            in digits, roman numerals, "S7", ranges, "caudate").
        location_words: word -> location names it stands for; a word ending in "*" also matches longer forms
            ("bilateral*" matches "bilaterally"). Words that stand for one name can be hedged ("left or right").
        csv: the organ's metadata-CSV columns.
        plausible_volume_cm3: plausible adult organ volume (low, high); outside -> a `qa_flags` entry, never a
            rejection (docs/decisions.md). Default: no bounds.
        mean_hu_window: plausible mean HU over the organ mask (lesions included) or its parenchyma, any phase: a
            mask whose mean falls outside is not on this organ (`emrl_data.reading.placement`, `emrl_data.labeling.labels`).
            Default: a generic soft-tissue window.
        mask_sides: organ mask file -> the side of the body's midline its centroid must lie on ("right"/"left",
            the patient's); files not listed have no expected side.
        anatomy: how synthetic data draws the organ (`OrganAnatomy`); None: the synthetic atlas cannot hold it.
    """

    name: str
    organ_masks: tuple[str, ...]
    lesion_mask: str
    lesion_aliases: tuple[str, ...] = ()
    lesion_fallbacks: tuple[str, ...] = ()
    lesion_prefixes: tuple[str, ...] = ()
    parts: tuple[tuple[str, str], ...] = ()
    single_location: bool = False
    display: str
    adjective: str
    location_phrase: str = "{}"
    whole_organ_phrase: str
    mentions: tuple[str, ...]
    mention_pattern: str | None = None
    words: tuple[str, ...] = ()
    word_prefixes: tuple[str, ...] = ()
    in_organ_nouns: str
    negation_modifiers: tuple[str, ...] = ()
    location_reader: str = "words"
    location_words: tuple[tuple[str, tuple[str, ...]], ...] = ()
    csv: CsvColumns
    plausible_volume_cm3: tuple[float, float] = (0.0, math.inf)
    mean_hu_window: tuple[float, float] = (-100.0, 300.0)
    mask_sides: tuple[tuple[str, str], ...] = ()
    anatomy: OrganAnatomy | None = None

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.strip().lower():
            raise ValueError(f"OrganSpec name={self.name!r} must be a non-empty lower-case word.")
        if not self.organ_masks:
            raise ValueError(f"OrganSpec {self.name}: organ_masks is empty.")
        if self.location_reader not in ("words", "couinaud"):
            raise ValueError(
                f"OrganSpec {self.name}: location_reader={self.location_reader!r} is 'words' or 'couinaud'."
            )
        if self.location_phrase.count("{}") != 1:
            raise ValueError(f"OrganSpec {self.name}: location_phrase={self.location_phrase!r} needs one '{{}}'.")
        names = set(self.location_names)
        for word, targets in self.location_words:
            if not set(targets) <= names:
                raise ValueError(f"OrganSpec {self.name}: location word {word!r} names {targets}, not in {names}.")
        if self.anatomy is not None:
            self._check_anatomy(self.anatomy)

    def _check_anatomy(self, anatomy: OrganAnatomy) -> None:
        """Refuse an anatomy whose files or locations are not this organ's."""
        drawn = [name for name, _ in anatomy.shapes]
        if sorted(drawn) != sorted(self.organ_masks):
            raise ValueError(
                f"OrganSpec {self.name}: anatomy.shapes draws {drawn}, not organ_masks {self.organ_masks}."
            )
        part_files = {stem for stem, _ in self.parts}
        regions = {region.file for region in anatomy.parts}
        undrawn = part_files - regions - set(self.organ_masks)
        if not regions <= part_files or undrawn:
            raise ValueError(
                f"OrganSpec {self.name}: anatomy.parts draws {sorted(regions)}; the parts are {sorted(part_files)}."
            )
        broken = {file for _, file in anatomy.defect_files}
        if not broken <= {*self.organ_masks, self.lesion_mask}:
            raise ValueError(
                f"OrganSpec {self.name}: anatomy.defect_files breaks {sorted(broken)}; its files are "
                f"{[*self.organ_masks, self.lesion_mask]}."
            )
        for side in anatomy.side_locations or ():
            if not set(side) <= set(self.location_names):
                raise ValueError(
                    f"OrganSpec {self.name}: anatomy.side_locations names {side}, not in {self.location_names}."
                )

    @property
    def location_names(self) -> tuple[str, ...]:
        """Location vocabulary in report order ("1".."8"; "head", "body", "tail"; "left", "right")."""
        return tuple(name for _, name in self.parts)

    @property
    def negative_findings(self) -> str:
        """The findings of a negative row ("No focal liver lesion is identified.")."""
        return f"No focal {self.adjective} lesion is identified."

    @property
    def negative_impression(self) -> str:
        """The impression of a negative row ("No liver tumor.")."""
        return f"No {self.adjective} tumor."


_BUILT_IN: tuple[OrganSpec, ...] = (
    OrganSpec(
        name="liver",
        organ_masks=("liver",),
        lesion_mask="liver_lesion",
        lesion_aliases=("hepatic_lesion",),
        lesion_fallbacks=("liver_tumor", "liver_cyst", "hepatic_tumor", "hepatic_cyst"),
        lesion_prefixes=("liver", "hepatic"),
        plausible_volume_cm3=(500.0, 5000.0),
        mean_hu_window=(-60.0, 250.0),  # severe steatosis ~-50 HU unenhanced; arterial/portal phases < ~200
        mask_sides=(("liver", "right"),),  # situs inversus (~1 in 10,000) is refused: docs/decisions.md
        parts=tuple((f"liver_segment_{i}", str(i)) for i in range(1, 9)),
        display="liver",
        adjective="liver",
        location_phrase="hepatic segment {}",
        whole_organ_phrase="the liver",
        mentions=("liver", "hepat", "couinaud", "caudate"),
        words=("liver", "hepatic", "couinaud", "caudate"),
        word_prefixes=("hepato",),
        in_organ_nouns="liver|hepatic parenchyma",
        negation_modifiers=("liver", "hepatic"),
        location_reader="couinaud",
        csv=CsvColumns.atlas("liver", "liver", "1-8"),
        # Couinaud-like segments: left lateral (u < -0.35) 2 above / 3 below; medial 1 (caudate, posterior) / 4;
        # right (u >= 0.05) 8 / 5 anterior and 7 / 6 posterior, superior / inferior.
        anatomy=OrganAnatomy(
            hu=60,
            shapes=(("liver", ((0.38, 0.05, 0.35), (0.34, 0.48, 0.30))),),
            parts=(
                PartRegion(file="liver_segment_1", u=(-0.35, 0.05), v=(-math.inf, -0.3)),
                PartRegion(file="liver_segment_2", u=(-math.inf, -0.35), w=(0.0, math.inf)),
                PartRegion(file="liver_segment_3", u=(-math.inf, -0.35), w=(-math.inf, 0.0)),
                PartRegion(file="liver_segment_4", u=(-0.35, 0.05), v=(-0.3, math.inf)),
                PartRegion(file="liver_segment_5", u=(0.05, math.inf), v=(0.0, math.inf), w=(-math.inf, 0.0)),
                PartRegion(file="liver_segment_6", u=(0.05, math.inf), v=(-math.inf, 0.0), w=(-math.inf, 0.0)),
                PartRegion(file="liver_segment_7", u=(0.05, math.inf), v=(-math.inf, 0.0), w=(0.0, math.inf)),
                PartRegion(file="liver_segment_8", u=(0.05, math.inf), v=(0.0, math.inf), w=(0.0, math.inf)),
            ),
            side_locations=(("5", "8"), ("2",)),
            defect_files=(
                ("lesion_outside_organ", "liver_lesion"),
                ("mask_grid_mismatch", "liver"),
                ("mask_orientation_conflict", "liver"),
                ("bad_metadata_row", "liver"),
            ),
        ),
    ),
    OrganSpec(
        name="pancreas",
        organ_masks=("pancreas",),
        lesion_mask="pancreatic_lesion",
        lesion_aliases=("pancreas_lesion",),
        lesion_fallbacks=(
            "pancreatic_tumor",
            "pancreatic_cyst",
            "pancreatic_pdac",
            "pancreatic_pnet",
            "pancreas_tumor",
            "pancreas_cyst",
            "pancreas_pdac",
            "pancreas_pnet",
        ),
        lesion_prefixes=("pancreas", "pancreatic"),
        plausible_volume_cm3=(15.0, 300.0),
        mean_hu_window=(-80.0, 250.0),  # fatty replacement reaches about -60
        parts=(("pancreas_head", "head"), ("pancreas_body", "body"), ("pancreas_tail", "tail")),
        display="pancreas",
        adjective="pancreatic",
        location_phrase="pancreas {}",
        whole_organ_phrase="the pancreas",
        mentions=("pancrea", "uncinate"),
        words=("uncinate",),
        word_prefixes=("pancrea",),
        in_organ_nouns="pancreas",
        negation_modifiers=("pancreatic", "pancreas"),
        location_words=(("head", ("head",)), ("body", ("body",)), ("tail", ("tail",)), ("uncinate", ("head",))),
        csv=CsvColumns.atlas("pancreatic", "pancreas", "head, body, tail"),
        # Thirds along x: the head on the patient's right.
        anatomy=OrganAnatomy(
            hu=40,
            shapes=(("pancreas", ((0.0, 0.05, -0.12), (0.42, 0.14, 0.14))),),
            parts=(
                PartRegion(file="pancreas_head", u=(1.0 / 3.0, math.inf)),
                PartRegion(file="pancreas_body", u=(-1.0 / 3.0, 1.0 / 3.0)),
                PartRegion(file="pancreas_tail", u=(-math.inf, -1.0 / 3.0)),
            ),
            side_locations=(("head",), ("body", "tail")),
            defect_files=(
                ("missing_organ_mask", "pancreas"),
                ("empty_organ_mask", "pancreas"),
                ("implausible_organ_hu", "pancreas"),
            ),
        ),
    ),
    OrganSpec(
        name="kidney",
        organ_masks=("kidney_left", "kidney_right"),
        lesion_mask="kidney_lesion",
        lesion_aliases=("renal_lesion",),
        lesion_fallbacks=("kidney_tumor", "kidney_cyst", "renal_tumor", "renal_cyst"),
        lesion_prefixes=("kidney", "renal"),
        plausible_volume_cm3=(60.0, 900.0),  # both kidneys together; one kidney (nephrectomy) stays above 60
        mean_hu_window=(-30.0, 400.0),  # excretory phase cortex and collecting system can average ~300
        mask_sides=(("kidney_left", "left"), ("kidney_right", "right")),
        parts=(("kidney_left", "left"), ("kidney_right", "right")),
        single_location=True,
        display="kidneys",
        adjective="kidney",
        location_phrase="{} kidney",
        whole_organ_phrase="the kidney",
        mentions=("kidney", "nephr"),
        mention_pattern=r"(?<!ad)renal",
        words=("kidney", "kidneys", "renal"),
        word_prefixes=("nephr",),
        in_organ_nouns="kidneys?",
        negation_modifiers=("renal", "kidney"),
        location_words=(
            ("left", ("left",)),
            ("right", ("right",)),
            ("bilateral*", ("left", "right")),
            ("both", ("left", "right")),
        ),
        csv=CsvColumns.atlas("kidney", "kidney", "left, right"),
        # The mask files are the parts (one kidney each side, posterior, below the liver).
        anatomy=OrganAnatomy(
            hu=150,
            shapes=(
                ("kidney_right", ((0.42, -0.38, -0.30), (0.14, 0.16, 0.22))),
                ("kidney_left", ((-0.42, -0.38, -0.30), (0.14, 0.16, 0.22))),
            ),
            defect_files=(("mask_values", "kidney_right"), ("flipped_affine_mask", "kidney_right")),
        ),
    ),
)

# The registry. Registration order is the organ order of every table and loop.
ORGANS: dict[Organ, OrganSpec] = {}
_MEMBERS: dict[str, Organ] = {}
_VERSION = [0]  # bumped on every change, so derived caches (the parser's patterns) know when to rebuild


def register_organ(spec: OrganSpec) -> Organ:
    """Add an organ to the registry and return it; every table, report, parser and loop then knows it.

    Raises:
        ValueError: when an organ of that name is already registered.
    """
    if spec.name in _MEMBERS:
        raise ValueError(f"organ {spec.name!r} is already registered.")
    organ = str.__new__(Organ, spec.name)
    _MEMBERS[spec.name] = organ
    ORGANS[organ] = spec
    _VERSION[0] += 1
    return organ


def unregister_organ(name: str) -> None:
    """Remove an organ registered with `register_organ` (tests restore the registry this way)."""
    organ = _MEMBERS.pop(str(name))
    del ORGANS[organ]
    _VERSION[0] += 1


def registry_version() -> int:
    """Return a number that changes whenever the registry changes."""
    return _VERSION[0]


def organ_spec(organ: str) -> OrganSpec:
    """Return the spec of a registered organ (by `Organ` or name); KeyError naming the registered ones otherwise."""
    try:
        return ORGANS[organ]  # type: ignore[index]  # a str looks up like the Organ of that name
    except KeyError:
        raise KeyError(f"{organ!r} is not a registered organ; registered: {list(_MEMBERS)}.") from None


def side_locations(organ: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Return the locations a synthetic training row names for a lesion on the image's left / right half.

    `OrganAnatomy.side_locations` when set, else the organ's first and last location name (both () for an organ
    without sub-structures).
    """
    spec = organ_spec(organ)
    if spec.anatomy is not None and spec.anatomy.side_locations is not None:
        return spec.anatomy.side_locations
    return spec.location_names[:1], spec.location_names[-1:]


class OrganTable(Mapping[Organ, T]):
    """A read-only mapping organ -> a value of its spec, always current with the registry (`LOCATION_NAMES[organ]`)."""

    def __init__(self, get: Callable[[OrganSpec], T]) -> None:
        self._get = get

    def __getitem__(self, organ: str) -> T:  # type: ignore[override]  # an organ name works too
        return self._get(organ_spec(organ))

    def __iter__(self) -> Iterator[Organ]:
        return iter(Organ)

    def __len__(self) -> int:
        return len(ORGANS)


for _spec in _BUILT_IN:
    register_organ(_spec)
Organ.LIVER, Organ.PANCREAS, Organ.KIDNEY = (Organ(s.name) for s in _BUILT_IN)

# Lookups under the names the rest of the code used before the registry (atlas.py re-exports them).
ORGAN_STRUCTURES: Mapping[Organ, OrganSpec] = ORGANS  # .organ_masks, .lesion_mask, .parts
LOCATION_NAMES: OrganTable[tuple[str, ...]] = OrganTable(lambda spec: spec.location_names)
PLAUSIBLE_ORGAN_VOLUME_CM3: OrganTable[tuple[float, float]] = OrganTable(lambda spec: spec.plausible_volume_cm3)
METADATA_COLUMNS: OrganTable[dict[str, str]] = OrganTable(lambda spec: spec.csv.as_dict())


def defect_files() -> dict[str, tuple[Organ, str]]:
    """Return every synthetic defect or quirk that acts on an organ's file: name -> (organ, file stem), from the
    registered organs' `OrganAnatomy.defect_files`. A CT defect or a case-level quirk is not in it."""
    return {
        name: (organ, file)
        for organ, spec in ORGANS.items()
        for name, file in (spec.anatomy.defect_files if spec.anatomy is not None else ())
    }
