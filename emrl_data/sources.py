"""Where rows come from: each source dataset's licence (an SPDX id) and citation, and whether licences combine.

Every row names its source (`source_dataset`, `source_case_id`, `source_license`); every table's manifest lists its
sources with their citations (`sources`), and the dataset card shows them. A table published as one config is one
work adapted from all its sources, so their licences must combine (`licence_conflict`, docs/decisions.md):

* a share-alike licence (CC-BY-SA-4.0, CC-BY-NC-SA-4.0) makes the whole set that licence: two different share-alike
  licences cannot both hold, and a share-alike licence that allows commercial use cannot take a non-commercial source;
* a non-commercial source keeps the set non-commercial: a set declared for commercial use cannot hold one.

An id this module does not know (`LicenseRef-...`: a challenge's own terms) is taken as non-commercial and not
share-alike: it is never published for commercial use. Sources published as separate configs are separate works:
no check between them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


# SPDX id -> (share-alike, non-commercial), for the licences the supported datasets and their code use.
LICENCE_TERMS: dict[str, tuple[bool, bool]] = {
    "CC0-1.0": (False, False),
    "CC-BY-4.0": (False, False),
    "MIT": (False, False),
    "Apache-2.0": (False, False),
    "CC-BY-SA-4.0": (True, False),
    "CC-BY-NC-4.0": (False, True),
    "CC-BY-NC-SA-4.0": (True, True),
}
SOURCE_COLUMNS = ("source_dataset", "source_case_id", "source_license")


@dataclass(frozen=True, slots=True)
class Source:
    """One source dataset: its layout name, the SPDX id of its data licence and what to cite."""

    dataset: str
    licence: str
    citation: str

    def columns(self, case_id: str) -> dict[str, str]:
        """The source columns of a row of case `case_id` (the dataset's own case id)."""
        return dict(zip(SOURCE_COLUMNS, (self.dataset, case_id, self.licence), strict=True))

    def to_dict(self) -> dict[str, str]:
        """The manifest entry of the source."""
        return {"dataset": self.dataset, "licence": self.licence, "citation": self.citation}

    @classmethod
    def from_dict(cls, entry: Mapping[str, Any]) -> Source:
        """A source from its manifest entry."""
        return cls(str(entry["dataset"]), str(entry["licence"]), str(entry["citation"]))


def share_alike(licence: str) -> bool:
    """Whether an adaptation must carry the same licence."""
    return LICENCE_TERMS.get(licence, (False, True))[0]


def non_commercial(licence: str) -> bool:
    """Whether commercial use is excluded (an unknown id: yes)."""
    return LICENCE_TERMS.get(licence, (False, True))[1]


def licence_conflict(licences: Iterable[str], *, commercial: bool = False) -> str | None:
    """Why sources under `licences` cannot be published as one work (naming the two licences), or None when they can.

    Args:
        licences: the SPDX ids of the sources of one config.
        commercial: the set is declared for commercial use.
    """
    found = sorted(set(licences))
    shared = [lic for lic in found if share_alike(lic)]
    if len(shared) > 1:
        return (
            f"{shared[0]} and {shared[1]} are both share-alike with different terms: one config cannot carry both; "
            "publish one config per source"
        )
    for other in found:
        if shared and non_commercial(other) and not non_commercial(shared[0]):
            return (
                f"{shared[0]} (share-alike, commercial use allowed) cannot take a {other} (non-commercial) source: "
                "publish one config per source"
            )
        if commercial and non_commercial(other):
            return f"{other} is non-commercial and the set is declared for commercial use (--commercial)"
    return None
