"""The dataset card (`README.md`) of a published table: Hub YAML front matter plus a readable body.

`render_dataset_card` is called by the table writers and read back by `flows/publish.py`. It is pure text: no Hub
client. The YAML `dataset_info.features` list mirrors `datasets.Features._to_yaml_list` (datasets 5.2), so the Hub and
`datasets.load_dataset` decode image columns (`dtype: image`, or `list: image` for a list of images) even without the
Parquet schema metadata.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml

from emrl_data.organs import ORGANS
from emrl_data.tables.shards import split_pattern, split_shards


LICENSE_NAME = "abdomenatlas-3.0"
LICENSE_LINK = "https://huggingface.co/datasets/AbdomenAtlas/AbdomenAtlas3.0Mini"
# SPDX ids the Hub's `license` field takes, lower-cased (https://huggingface.co/docs/hub/repositories-licenses).
HUB_LICENCE_IDS = frozenset(
    {"CC0-1.0", "CC-BY-4.0", "CC-BY-SA-4.0", "CC-BY-NC-4.0", "CC-BY-NC-SA-4.0", "MIT", "Apache-2.0"}
)
REPO_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
VERSION_PATTERN = re.compile(r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)$")

# "{organs}" stands for the registered organs (`organ_names_prose`), filled in when a card is rendered.
TABLE_DESCRIPTIONS: dict[str, str] = {
    "sft": (
        "Supervised fine-tuning set: one row per (case, organ) for {organs}. Each row holds the "
        "organ's axial CT frames (8-bit grayscale PNG, numbered 1..N from inferior to superior), the user prompt, "
        "the target report in the E-MRL format and the label columns, named exactly as the GRPO reward arguments."
    ),
    "findings": (
        "Every organ row the curation produced, with all labels and their provenance (no frames). The `sft` and "
        "`rl_hardset` tables are drawn from it."
    ),
    "rl_hardset": (
        "Hard cases for E-MRL GRPO: train rows an SFT checkpoint gets wrong (an attribute or the key slice), with "
        "the reason each row was chosen."
    ),
    "rejections": (
        "Every (case, organ) the curation could not use, with the step, a reason code and a detail: nothing is "
        "dropped silently."
    ),
    "predictions": "Model reports on the test split, their parsed fields and their scores.",
}
TABLE_TASKS: dict[str, list[str]] = {
    "sft": ["image-text-to-text", "visual-question-answering"],
    "rl_hardset": ["image-text-to-text", "visual-question-answering"],
}
DEFAULT_TASKS = ["image-text-to-text"]
TAGS = ["medical", "ct", "radiology", "tumor", "abdomenatlas", "radgpt", "e-mrl"]

# What every label column means (docs/contract.md#labels) ("{locations}": each registered organ's location names, `location_prose`).
LABEL_DEFINITIONS: tuple[tuple[str, str], ...] = (
    ("`has_lesion`", "the organ's lesion mask has at least one component that survives the noise filter"),
    (
        "components",
        "26-connected components of the lesion mask; those below `min_lesion_volume_mm3` (default 10 mm³, "
        "RadGPT's `--th 10`) are dropped",
    ),
    ("`lesion_count`", "surviving components"),
    ("largest lesion", "the component with the largest volume; every attribute below is about it"),
    (
        "`long_axis_mm`, `short_axis_mm`",
        "longest in-plane (axial) diameter over all its slices (Feret), and the perpendicular extent on that "
        "slice; reports give them in cm with one decimal",
    ),
    ("`volume_mm3`", "voxel count × voxel volume"),
    (
        "`key_slice_z_vox`",
        "axial slice of maximum cross-sectional area of the largest lesion (ties: lowest z); RadGPT's "
        "longest-diameter slice is `max_diameter_z_vox`",
    ),
    (
        "`bbox_xyxy_vox`",
        "2-D box `[x0, y0, x1, y1)` (half-open) of the largest lesion on the key slice, in canonical RAS voxels",
    ),
    (
        "`location`",
        "sub-structures holding more than 10 % of the lesion's labelled voxels ({locations}); a sorted list",
    ),
    (
        "`attenuation`",
        "RadGPT's rule: lesion mean HU vs parenchyma (organ minus all lesions) mean ± SD/10 → `iso`; below → "
        "`hypo`; above → `hyper`",
    ),
    (
        "frames",
        "the organ's z-extent ± 2 slices, at most 32 frames sampled uniformly and always including the key slice, "
        "numbered 1..N from inferior to superior; window W400/L40",
    ),
    (
        "`key_slice_frame`, `bbox_xyxy_px`, `bbox_qwen`",
        "the key slice as a 1-based frame number, its box in frame pixels, and the same box on Qwen3-VL's 0-1000 "
        "grid (the report's `<bbox>`)",
    ),
)

EMRL_TITLE = (
    "E-MRL: Cross-view Aligned Evidence-driven Multimodal Reinforcement Learning for Reliable 3D Tumor Analysis"
)
CITATIONS = """\
```bibtex
@article{bassi2025radgpt,
  title   = {{RadGPT}: Constructing {3D} Image-Text Tumor Datasets},
  author  = {Bassi, Pedro R. A. S. and others},
  journal = {arXiv preprint arXiv:2501.04678},
  year    = {2025}
}

@inproceedings{li2026emrl,
  title         = {{E-MRL}: Cross-view Aligned Evidence-driven Multimodal Reinforcement Learning for Reliable {3D} Tumor Analysis},
  author        = {Li, Sijing and Qiu, Zhongwei and Wang, Zhuoya and Yun, Boxiang and Yi, Zhenyu and Xu, Jianwei and Zhang, Wenqiao and Xia, Yingda and Zhang, Ling},
  booktitle     = {Medical Image Computing and Computer Assisted Intervention (MICCAI)},
  year          = {2026},
  eprint        = {2606.23888},
  archivePrefix = {arXiv}
}
```"""


def _camel_to_snake(name: str) -> str:
    """Return `ClassLabel` -> `class_label`, `Image` -> `image` (as `datasets.utils.py_utils.camelcase_to_snakecase`)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _simplify(feature: dict[str, Any]) -> dict[str, Any]:
    """Collapse `list: {dtype: X}` to `list: X` and `list: {struct: [...]}` to `list: [...]`; number class labels."""
    for list_type in ("large_list", "list", "sequence"):
        inner = feature.get(list_type)
        if isinstance(inner, dict) and list(inner) == ["dtype"]:
            feature[list_type] = inner["dtype"]
        elif isinstance(inner, dict) and list(inner) == ["struct"]:
            feature[list_type] = inner["struct"]
    class_label = feature.get("class_label")
    if isinstance(class_label, dict) and isinstance(class_label.get("names"), list):
        # The Hub requires string keys.
        class_label["names"] = {str(i): name for i, name in enumerate(class_label["names"])}
    return feature


def _yaml_feature(obj: Any) -> dict[str, Any]:
    """Return the YAML form of one feature given as its JSON dict (the rules of `Features._to_yaml_list`)."""
    if isinstance(obj, (list, tuple)):
        return _simplify({"list": _simplify(_yaml_feature(obj[0]))})
    if not isinstance(obj, dict):
        raise TypeError(f"A feature must be a dict or a list, got {type(obj).__name__}: {obj!r}.")
    obj = dict(obj)
    kind = obj.pop("_type", None)
    if kind in ("List", "LargeList", "Sequence"):
        inner = obj.pop("feature")
        key = "large_list" if kind == "LargeList" else "list"
        return _simplify({key: _yaml_feature(inner), **obj})
    if kind == "Value":
        return obj
    if kind and not obj:
        return {"dtype": _camel_to_snake(kind)}
    if kind:
        return {"dtype": _simplify({_camel_to_snake(kind): obj})}
    return {"struct": [{"name": name, **_yaml_feature(sub)} for name, sub in obj.items()]}


def features_to_yaml_list(features: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Return the card's `dataset_info.features` list for a Hub features dict.

    Args:
        features: the Hub features JSON (`{"col": {"dtype": "string", "_type": "Value"}, "frames": {"feature":
            {"_type": "Image"}, "_type": "List"}, ...}`), as carried by the Parquet schema metadata under
            `huggingface` -> `info` -> `features`.

    Returns:
        One `{"name": col, ...}` entry per column, in column order, e.g. `{"name": "frames", "list": "image"}`.
    """
    return _yaml_feature(copy.deepcopy(dict(features)))["struct"]


def _type_string(feature: Any) -> str:
    """Return a short readable type for the column table: `string`, `list<int32>`, `list<image>`, `struct`."""
    if isinstance(feature, (list, tuple)):
        return f"list<{_type_string(feature[0])}>"
    kind = feature.get("_type")
    if kind in ("List", "LargeList", "Sequence"):
        return f"list<{_type_string(feature['feature'])}>"
    if kind == "Value":
        return str(feature["dtype"])
    if kind:
        return _camel_to_snake(kind)
    return "struct<" + ", ".join(f"{name}: {_type_string(sub)}" for name, sub in feature.items()) + ">"


def _size_category(n_rows: int) -> str:
    """Return the Hub `size_categories` bucket of a row count."""
    for limit, label in ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M")):
        if n_rows < limit:
            return label
    return "n>1M"


_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)


def _escape_plain(text: str) -> str:
    """Escape what breaks a table cell or turns into HTML outside code spans: `|`, `<`, `>`."""
    return text.replace("|", r"\|").replace("<", "&lt;").replace(">", "&gt;")


def md_cell(text: str) -> str:
    """Return `text` safe inside one cell of a GitHub-flavoured markdown table (what the Hub renders).

    `|` becomes `\\|` everywhere (GFM splits cells on a bare `|` even inside a code span, and renders `\\|` there as
    `|`); `<` and `>` become `&lt;`/`&gt;` outside code spans, so `list<string>` is not swallowed as an HTML tag
    (inside a code span they are literal already). Newlines become spaces: a cell is one line.
    """
    out: list[str] = []
    pos = 0
    for match in _CODE_SPAN.finditer(text):
        out.append(_escape_plain(text[pos : match.start()]))
        out.append(match.group(0).replace("|", r"\|"))
        pos = match.end()
    out.append(_escape_plain(text[pos:]))
    return " ".join("".join(out).splitlines())


def md_row(cells: Sequence[str]) -> str:
    """Return one markdown table row of already escaped cells."""
    return "| " + " | ".join(cells) + " |"


def _counts_table(row_counts: Mapping[str, Mapping[str, int]], splits: Sequence[str]) -> str:
    """Return a markdown table: one row per group (e.g. `liver/positive`, `total` last), one column per split."""
    columns = [s for s in splits if s in row_counts] + sorted(s for s in row_counts if s not in splits)
    groups = sorted({g for counts in row_counts.values() for g in counts}, key=lambda g: (g == "total", g))
    lines = [md_row(["rows", *(f"`{md_cell(c)}`" for c in columns)]), "| --- |" + " ---: |" * len(columns)]
    for group in groups:
        lines.append(md_row([md_cell(group), *(str(row_counts[c].get(group, 0)) for c in columns)]))
    return "\n".join(lines)


def _split_rows(counts: Mapping[str, int]) -> int:
    """Return the rows of one split: its `total` when present, else the sum of its groups."""
    return counts["total"] if "total" in counts else sum(counts.values())


def _total_rows(row_counts: Mapping[str, Mapping[str, int]]) -> int:
    """Return the number of rows over all splits."""
    return sum(_split_rows(counts) for counts in row_counts.values())


def _licence_fields(sources: Sequence[Mapping[str, str]] | None) -> dict[str, Any]:
    """The front matter's `license`: the Hub ids of the sources' SPDX licences (one, or a list), else `other` with
    AbdomenAtlas 3.0's terms (no sources named) or the first licence the Hub has no id for (`LicenseRef-LiTS`)."""
    licences = sorted({s["licence"] for s in sources or ()})
    unknown = [lic for lic in licences if lic not in HUB_LICENCE_IDS]
    if not licences or unknown:
        name = LICENSE_NAME if not licences else unknown[0].removeprefix("LicenseRef-").lower()
        link = LICENSE_LINK if not licences else None
        return {"license": "other", "license_name": name} | ({"license_link": link} if link else {})
    ids = [lic.lower() for lic in licences]
    return {"license": ids[0] if len(ids) == 1 else ids}


def _front_matter(
    table: str,
    features: dict[str, Any],
    row_counts: Mapping[str, Mapping[str, int]],
    splits: Sequence[str],
    split_bytes: Mapping[str, int] | None = None,
    sources: Sequence[Mapping[str, str]] | None = None,
) -> str:
    """Return the YAML front matter: license, tasks, the `default` config and `dataset_info` (features, splits)."""
    front_matter = {
        **_licence_fields(sources),
        "pretty_name": f"E-MRL {table}",
        "language": ["en"],
        "task_categories": TABLE_TASKS.get(table, DEFAULT_TASKS),
        "tags": TAGS,
        "size_categories": [_size_category(_total_rows(row_counts))],
        "configs": [
            {
                "config_name": "default",
                "data_files": [{"split": split, "path": split_pattern(split)} for split in splits],
            }
        ],
        "dataset_info": {
            "features": features_to_yaml_list(features),
            "splits": [
                {"name": split}
                | ({"num_bytes": split_bytes[split]} if split_bytes is not None else {})
                | {"num_examples": _split_rows(row_counts.get(split, {}))}
                for split in splits
            ],
        },
    }
    return yaml.safe_dump(front_matter, sort_keys=False, allow_unicode=True, width=1000)


def parquet_split_bytes(data_dir: Path, splits: Sequence[str]) -> dict[str, int]:
    """Uncompressed bytes of each split's shards (`split_shards`), from the Parquet footers.

    This is the `num_bytes` of the card's `dataset_info.splits` (the data's size in memory, not on disk); it is read
    from the footers only, so it is exact for the shards and costs no decoding.
    """
    sizes = {}
    for split in splits:
        metadata = [pq.read_metadata(p) for p in split_shards(Path(data_dir), split)]
        sizes[split] = sum(m.row_group(i).total_byte_size for m in metadata for i in range(m.num_row_groups))
    return sizes


# The three release-dependent parts of a card. An unreleased card (a local build) has the `None` forms; `release_card`
# swaps them for the released forms, so a published card is byte-identical to one rendered with the release.
def _title(table: str, version: str | None) -> str:
    return f"# E-MRL `{table}`" + (f" v{version}" if version else "")


def _loading(repo_id: str | None, version: str | None) -> str:
    if repo_id is None or version is None:
        call = 'load_dataset("path/to/this/folder")  # a local build, not released yet'
    else:
        call = f'load_dataset("{repo_id}", revision="v{version}")  # a pinned release; image columns decode to PIL'
    return f"```python\nfrom datasets import load_dataset\n\nds = {call}\n```"


def _release_row(repo_id: str | None, version: str | None) -> str:
    if repo_id is None or version is None:
        return md_row(["release", "not released: a local build (`emrl publish` writes the repo and tag here)"])
    return md_row(["release", f"`v{version}` of `{repo_id}`"])


def _check_release(version: str | None, repo_id: str | None) -> None:
    """Raise ValueError unless `version` and `repo_id` are both None or both valid."""
    if (version is None) != (repo_id is None):
        raise ValueError(f"version={version!r} and repo_id={repo_id!r} go together: give both or neither.")
    if version is not None and not VERSION_PATTERN.fullmatch(version):
        raise ValueError(f"version={version!r} is not X.Y.Z (e.g. '1.2.0'); the tag is then 'v1.2.0'.")
    if repo_id is not None and not REPO_ID_PATTERN.fullmatch(repo_id):
        raise ValueError(f"repo_id={repo_id!r} is not 'owner/name'.")


def release_card(card: str, *, repo_id: str, version: str) -> str:
    """Return an unreleased card (rendered with `version=None, repo_id=None`) stamped as release `v{version}` of `repo_id`.

    The result equals `render_dataset_card(..., version=version, repo_id=repo_id)` with the card's other inputs.

    Raises:
        ValueError: on a bad version or repo id, or a card that is not an unreleased card of this module.
    """
    _check_release(version, repo_id)
    title = re.search(r"^# E-MRL `([^`\n]+)`$", card, flags=re.MULTILINE)
    if title is None:
        raise ValueError("the card has no '# E-MRL `<table>`' title: not an unreleased card of emrl_data.tables.card.")
    stamped = card[: title.start()] + _title(title.group(1), version) + card[title.end() :]
    swaps = [
        (_loading(None, None), _loading(repo_id, version)),
        (_release_row(None, None), _release_row(repo_id, version)),
    ]
    for old, new in swaps:
        if stamped.count(old) != 1:
            raise ValueError("the card lacks its unreleased loading or release line: not an unreleased card.")
        stamped = stamped.replace(old, new)
    return stamped


def _provenance_table(
    repo_id: str | None,
    version: str | None,
    pipeline_version: str,
    git_sha: str | None,
    config_fingerprint: str,
    atlas_source: str | None = None,
) -> str:
    """Return the provenance table: release, source atlas (when read from the Hub, pinned), pipeline version, git sha,
    config fingerprint."""
    rows = [md_row(["field", "value"]), "| --- | --- |", _release_row(repo_id, version)]
    if atlas_source is not None:
        rows.append(md_row(["source atlas (pinned commit)", f"`{md_cell(atlas_source)}`"]))
    rows += [
        md_row(["pipeline version", f"`{md_cell(pipeline_version)}`"]),
        md_row(["git sha", f"`{md_cell(git_sha or 'unknown')}`"]),
        md_row(["config fingerprint", f"`{md_cell(config_fingerprint)}`"]),
    ]
    return "\n".join(rows)


def _columns_table(features: Mapping[str, Any], descriptions: Mapping[str, str]) -> str:
    """Return the column table: name, type (in a code span, so `list<string>` shows), meaning (escaped)."""
    rows = [md_row(["column", "type", "meaning"]), "| --- | --- | --- |"]
    for name, feature in features.items():
        type_text = _type_string(feature).replace("|", r"\|")
        rows.append(md_row([f"`{md_cell(name)}`", f"`{type_text}`", md_cell(descriptions.get(name, ""))]))
    return "\n".join(rows)


def _label_table(definitions: Sequence[tuple[str, str]]) -> str:
    """Return the label-definition table, every cell escaped."""
    rows = [md_row(["label", "definition"]), "| --- | --- |"]
    rows += [md_row([md_cell(label), md_cell(text)]) for label, text in definitions]
    return "\n".join(rows)


def organ_names_prose() -> str:
    """Return the registered organs as prose, in registry order ("liver, pancreas and kidney")."""
    names = [str(organ) for organ in ORGANS]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def location_prose() -> str:
    """Return each registered organ's location names ("liver `1`..`8`, pancreas `head`/`body`/`tail`, ...")."""
    parts = []
    for organ, spec in ORGANS.items():
        names = spec.location_names
        if not names:
            parts.append(f"{organ}: none, the whole organ")
        elif all(n.isdigit() for n in names) and [int(n) for n in names] == list(
            range(int(names[0]), int(names[0]) + len(names))
        ):
            parts.append(f"{organ} `{names[0]}`..`{names[-1]}`")
        else:
            parts.append(f"{organ} " + "/".join(f"`{n}`" for n in names))
    return ", ".join(parts)


def default_label_definitions() -> str:
    """Return the label table of docs/contract.md#labels for the organs registered now, with the volume convention."""
    locations = location_prose()
    definitions = [(label, text.replace("{locations}", locations)) for label, text in LABEL_DEFINITIONS]
    return (
        _label_table(definitions)
        + "\n\nVolumes are in canonical RAS voxel order `(x, y, z)`, z from inferior to superior. Values from the "
        "atlas metadata CSV are kept beside ours as `atlas_*` columns, never silently preferred."
    )


def table_description(table: str) -> str:
    """Return the card's opening paragraph for `table`, naming the organs registered now."""
    text = TABLE_DESCRIPTIONS.get(table, f"The `{table}` table of the E-MRL data pipeline.")
    return text.replace("{organs}", organ_names_prose())


def _licence_sections(sources: Sequence[Mapping[str, str]] | None) -> list[str]:
    """The License and Citation sections: AbdomenAtlas 3.0's terms, or a table of each source's licence and citation."""
    emrl = f'E-MRL (Li et al., "{EMRL_TITLE}", MICCAI 2026, arXiv 2606.23888)'
    if not sources:
        return [
            "## License",
            "Derived from AbdomenAtlas 3.0: the images and labels are under the AbdomenAtlas 3.0 terms "
            f"([dataset card]({LICENSE_LINK})). Check them before any use or redistribution.",
            "## Citation",
            f"If you use this data, cite AbdomenAtlas 3.0 / RadGPT (Bassi et al. 2025, arXiv 2501.04678) and {emrl}.",
        ]
    rows = [md_row(["source", "licence (SPDX)", "cite"]), "| --- | --- | --- |"]
    rows += [md_row([f"`{md_cell(s['dataset'])}`", md_cell(s["licence"]), md_cell(s["citation"])]) for s in sources]
    return [
        "## License",
        "Each row's images and labels are under its source's licence (columns `source_dataset`, `source_license`): "
        "check it before any use or redistribution.\n\n" + "\n".join(rows),
        "## Citation",
        f"If you use this data, cite each source above and {emrl}.",
    ]


def render_dataset_card(
    *,
    table: str,
    features: dict[str, Any],
    row_counts: dict[str, dict[str, int]],
    pipeline_version: str,
    git_sha: str | None,
    config_fingerprint: str,
    label_definitions: str | None = None,
    metrics_markdown: str | None = None,
    splits: Sequence[str] = ("train", "test"),
    version: str | None = None,
    repo_id: str | None = None,
    descriptions: Mapping[str, str] | None = None,
    split_bytes: Mapping[str, int] | None = None,
    atlas_source: str | None = None,
    sources: Sequence[Mapping[str, str]] | None = None,
) -> str:
    """Return the `README.md` text of a table folder: Hub YAML front matter, then the card body.

    The front matter declares the license, one `default` config whose splits read `data/{split}-*.parquet`
    (`split_pattern`), and `dataset_info` with the features (image columns as `dtype: image` / `list: image`) and the
    rows of every split (`splits: [{name, num_bytes, num_examples}]`; `datasets` ignores a split list without
    `num_bytes`). The body says what the table is, how to load it, the provenance (release, pipeline version, git sha,
    config fingerprint), the row counts, the columns, the label definitions, Table 1/2 when given, the license and the
    complete citations. Every table cell is escaped (`md_cell`).

    Args:
        table: the table name (`sft`, `findings`, `rl_hardset`, `rejections`, `predictions`, or another name).
        features: the Hub features dict of the table (see `features_to_yaml_list`).
        row_counts: counts per split, then per group, e.g. `{"train": {"liver/positive": 3, "total": 5}, ...}`
            (the layout of `emrl_data.tables.table_folder.count_rows`). Shown as a table, one column per split.
        pipeline_version: version of the pipeline that built the table.
        git_sha: commit of the pipeline code, or None when unknown (shown as "unknown").
        config_fingerprint: `CurateConfig.fingerprint()` of the run.
        label_definitions: markdown for the label section; None uses the table of docs/contract.md#labels.
        metrics_markdown: Table 1/2 (or other results) as markdown; None leaves the section out.
        splits: the splits of the `default` config; every one must have at least one shard in `data/`.
        version: the release version `X.Y.Z` (the repo tag is `vX.Y.Z`), or None for a local build.
        repo_id: the Hub dataset repo `owner/name` of the release; given exactly when `version` is.
        descriptions: column name -> meaning (plain text; escaped here).
        split_bytes: uncompressed bytes per split (`parquet_split_bytes`); None leaves `num_bytes` out.
        atlas_source: `hf://datasets/OWNER/NAME@SHA` when the atlas was read from the Hub; None for a folder.
        sources: the source datasets (`emrl_data.sources.Source.to_dict`: dataset, licence, citation); the License
            and Citation sections name each; None: AbdomenAtlas 3.0 alone.

    Returns:
        The card text, starting with `---` and ending with a newline.

    Raises:
        ValueError: on an empty `splits`, a `version` that is not `X.Y.Z`, or only one of `version` and `repo_id`.
    """
    if not splits:
        raise ValueError("splits is empty; the card's default config needs at least one split.")
    _check_release(version, repo_id)
    body = [
        _title(table, version),
        table_description(table),
        "Built from AbdomenAtlas 3.0 CT volumes and per-structure masks by the E-MRL data pipeline, a reference "
        "implementation of the data side of E-MRL (MICCAI 2026, arXiv 2606.23888).",
        "## Loading",
        _loading(repo_id, version),
        "## Provenance",
        _provenance_table(repo_id, version, pipeline_version, git_sha, config_fingerprint, atlas_source),
        "## Row counts",
        _counts_table(row_counts, splits),
        "## Columns",
        _columns_table(features, descriptions or {}),
        "## Label definitions",
        (label_definitions if label_definitions is not None else default_label_definitions()).strip(),
    ]
    if metrics_markdown is not None:
        body += ["## Results", metrics_markdown.strip()]
    body += [*_licence_sections(sources), CITATIONS]
    front = _front_matter(table, features, row_counts, splits, split_bytes, sources)
    return f"---\n{front}---\n\n" + "\n\n".join(body) + "\n"
