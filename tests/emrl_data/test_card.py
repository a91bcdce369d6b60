"""Tests of `emrl_data.tables.card`: the YAML front matter the Hub and `datasets` read, and the card body."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from datasets import ClassLabel, Features, Image, LargeList, List, Value
from huggingface_hub import DatasetCard, DatasetCardData
from PIL import Image as PILImage

from emrl_data.organs import register_organ, unregister_organ
from emrl_data.tables.card import (
    default_label_definitions,
    features_to_yaml_list,
    md_cell,
    parquet_split_bytes,
    release_card,
    render_dataset_card,
)
from tests.emrl_data.test_organs import SPLEEN


SFT_LIKE = Features(
    {
        "case_id": Value("string"),
        "has_lesion": Value("bool"),
        "lesion_count": Value("int32"),
        "long_axis_mm": Value("float64"),
        "location": List(Value("string")),
        "bbox_xyxy_px": List(Value("int32")),
        "frames": List(Image()),
    }
)


def _front_matter(card: str) -> dict[str, Any]:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def _card(**overrides: Any) -> str:
    kwargs: dict[str, Any] = {
        "table": "sft",
        "features": SFT_LIKE.to_dict(),
        "row_counts": {
            "train": {"liver/negative": 2, "liver/positive": 3, "total": 5},
            "test": {"liver/positive": 1, "total": 1},
        },
        "pipeline_version": "0.1.0",
        "git_sha": "0123abc",
        "config_fingerprint": "fedcba9876543210",
    }
    return render_dataset_card(**(kwargs | overrides))


@pytest.mark.parametrize(
    "features",
    [
        Features({"a": Value("string"), "b": Value("int32")}),  # plain values
        Features({"img": Image()}),  # one image -> dtype: image
        Features({"frames": List(Image())}),  # a list of images -> list: image
        Features({"box": List(Value("int32"), length=4)}),  # fixed-length list keeps its length
        Features({"s": {"x": Value("int64"), "y": List(Value("string"))}}),  # struct
        Features({"grid": List(List(Value("int32")))}),  # nested list
        Features({"items": List({"k": Value("string"), "im": Image()})}),  # list of structs
        Features({"label": ClassLabel(names=["neg", "pos"])}),  # class labels get string keys
        Features({"big": LargeList(Value("float32"))}),  # large list
        SFT_LIKE,  # the shape of the sft table
    ],
)
def test_features_to_yaml_list_matches_datasets(features: Features) -> None:
    assert features_to_yaml_list(features.to_dict()) == features._to_yaml_list()


def test_features_to_yaml_list_images_exact() -> None:
    features = Features({"img": Image(), "frames": List(Image())}).to_dict()
    assert features_to_yaml_list(features) == [{"name": "img", "dtype": "image"}, {"name": "frames", "list": "image"}]


def test_render_dataset_card_front_matter_round_trips_into_features() -> None:
    front = _front_matter(_card())
    assert Features._from_yaml_list(front["dataset_info"]["features"]) == SFT_LIKE
    assert front["configs"] == [
        {
            "config_name": "default",
            "data_files": [
                {"split": "train", "path": "data/train-*.parquet"},
                {"split": "test", "path": "data/test-*.parquet"},
            ],
        }
    ]
    assert front["license"] == "other"
    assert front["license_name"] == "abdomenatlas-3.0"
    assert front["license_link"].startswith("https://")
    assert front["task_categories"] == ["image-text-to-text", "visual-question-answering"]
    assert "medical" in front["tags"]
    assert front["size_categories"] == ["n<1K"]


@pytest.mark.parametrize(
    ("splits", "paths"),
    [
        (("train",), ["data/train-*.parquet"]),  # a single split
        (("test", "train"), ["data/test-*.parquet", "data/train-*.parquet"]),  # order kept
    ],
)
def test_render_dataset_card_configs_follow_splits(splits: tuple[str, ...], paths: list[str]) -> None:
    front = _front_matter(_card(splits=splits))
    assert [f["path"] for f in front["configs"][0]["data_files"]] == paths


def test_render_dataset_card_row_counts_table_exact() -> None:
    expected = "\n".join(
        [
            "| rows | `train` | `test` |",
            "| --- | ---: | ---: |",
            "| liver/negative | 2 | 0 |",
            "| liver/positive | 3 | 1 |",
            "| total | 5 | 1 |",
        ]
    )
    assert expected in _card()


def test_render_dataset_card_provenance_and_version() -> None:
    card = _card(version="1.2.0", repo_id="my-org/emrl-sft")
    assert "| release | `v1.2.0` of `my-org/emrl-sft` |" in card
    assert "| pipeline version | `0.1.0` |" in card
    assert "| git sha | `0123abc` |" in card
    assert "| config fingerprint | `fedcba9876543210` |" in card
    assert 'ds = load_dataset("my-org/emrl-sft", revision="v1.2.0")' in card
    assert "\n# E-MRL `sft` v1.2.0\n" in card
    for placeholder in ("unreleased", "not released", "<repo_id>", "vX.Y.Z", "path/to/this/folder"):
        assert placeholder not in card


def test_render_dataset_card_unknown_git_sha_and_no_version() -> None:
    card = _card(git_sha=None)
    assert "| git sha | `unknown` |" in card
    assert "| release | not released: a local build (`emrl publish` writes the repo and tag here) |" in card
    assert 'ds = load_dataset("path/to/this/folder")  # a local build, not released yet' in card
    assert "\n# E-MRL `sft`\n" in card


def test_release_card_equals_a_card_rendered_with_the_release() -> None:
    stamped = release_card(_card(), repo_id="my-org/emrl-sft", version="1.2.0")
    assert stamped == _card(version="1.2.0", repo_id="my-org/emrl-sft")


@pytest.mark.parametrize(
    ("card", "kwargs", "message"),
    [
        (None, {"repo_id": "my-org/x", "version": "1.0"}, "is not X.Y.Z"),
        (None, {"repo_id": "no-namespace", "version": "1.0.0"}, "is not 'owner/name'"),
        ("released", {"repo_id": "my-org/x", "version": "1.0.1"}, "not an unreleased card"),  # stamped twice
        ("# something else\n", {"repo_id": "my-org/x", "version": "1.0.0"}, "not an unreleased card"),
    ],
)
def test_release_card_refuses_bad_input(card: str | None, kwargs: dict[str, str], message: str) -> None:
    text = {None: _card(), "released": _card(version="1.0.0", repo_id="my-org/x")}.get(card, card)
    with pytest.raises(ValueError, match=message):
        release_card(text, **kwargs)


@pytest.mark.parametrize(
    ("text", "cell"),
    [
        ("liver | pancreas | kidney", r"liver \| pancreas \| kidney"),
        ("list<string>", "list&lt;string&gt;"),
        ("a `<bbox>` tag", "a `<bbox>` tag"),  # literal inside a code span
        ("`a|b` or c", r"`a\|b` or c"),  # GFM splits on | even inside a code span
        ("two\nlines", "two lines"),
        ("plain", "plain"),
    ],
)
def test_md_cell_table(text: str, cell: str) -> None:
    assert md_cell(text) == cell


def _table_rows(markdown: str) -> list[list[str]]:
    """Return the tables of a markdown text, each as its lines (consecutive lines starting with '|')."""
    tables: list[list[str]] = []
    previous = False
    for line in markdown.splitlines():
        is_row = line.startswith("|")
        if is_row and not previous:
            tables.append([])
        if is_row:
            tables[-1].append(line)
        previous = is_row
    return tables


def _cells(row: str) -> int:
    return len(re.split(r"(?<!\\)\|", row.strip())) - 2  # leading and trailing pipes


def test_every_table_row_has_as_many_cells_as_its_header() -> None:
    descriptions = {"case_id": "BDMAP id", "location": "liver | pancreas | kidney", "frames": "a | b <c>"}
    card = _card(descriptions=descriptions, version="1.0.0", repo_id="my-org/x")
    tables = _table_rows(DatasetCard(card).text)
    assert len(tables) == 4  # provenance, row counts, columns, label definitions
    for table in tables:
        header = _cells(table[0])
        assert header >= 2
        assert [_cells(row) for row in table] == [header] * len(table), table
    assert "| `location` | `list<string>` | liver \\| pancreas \\| kidney |" in card
    assert "| `frames` | `list<image>` | a \\| b &lt;c&gt; |" in card


def test_card_parses_with_huggingface_hub_dataset_card() -> None:
    card = DatasetCard(_card(version="1.0.0", repo_id="my-org/x"))
    data = card.data.to_dict()
    assert isinstance(card.data, DatasetCardData)
    assert data["dataset_info"]["splits"] == [
        {"name": "train", "num_examples": 5},
        {"name": "test", "num_examples": 1},
    ]
    assert data["configs"][0]["data_files"] == [
        {"split": "train", "path": "data/train-*.parquet"},
        {"split": "test", "path": "data/test-*.parquet"},
    ]
    assert data["license"] == "other" and data["pretty_name"] == "E-MRL sft"
    assert card.text.startswith("\n# E-MRL `sft` v1.0.0\n")


def test_split_sizes_count_groups_when_there_is_no_total() -> None:
    front = _front_matter(_card(row_counts={"train": {"a/x": 2, "b/y": 3}}, splits=("train",)))
    assert front["dataset_info"]["splits"] == [{"name": "train", "num_examples": 5}]


def test_split_sizes_carry_num_bytes_so_datasets_keeps_them(tmp_path: Path) -> None:
    # Without num_bytes, `datasets` logs "The `splits` field in YAML is malformed or missing the
    # name/num_examples/num_bytes fields" and drops the split list (seen when publishing).
    data = tmp_path / "data"
    data.mkdir()
    table = pa.table({"a": pa.array(["x" * 100] * 10), "b": pa.array(range(10), pa.int64())})
    pq.write_table(table, data / "train-00000-of-00002.parquet", row_group_size=4)  # 3 row groups
    pq.write_table(table.slice(0, 5), data / "train-00001-of-00002.parquet")
    pq.write_table(table.slice(0, 1), data / "test-00000-of-00001.parquet")
    sizes = parquet_split_bytes(data, ("train", "test"))
    footers = [pq.read_metadata(p) for p in sorted(data.glob("train-*.parquet"))]
    assert sizes["train"] == sum(m.row_group(i).total_byte_size for m in footers for i in range(m.num_row_groups))
    assert sizes["test"] == pq.read_metadata(data / "test-00000-of-00001.parquet").row_group(0).total_byte_size
    assert sizes["train"] > sizes["test"] > 0
    front = _front_matter(_card(split_bytes=sizes))
    assert front["dataset_info"]["splits"] == [
        {"name": "train", "num_bytes": sizes["train"], "num_examples": 5},
        {"name": "test", "num_bytes": sizes["test"], "num_examples": 1},
    ]
    parsed = datasets.SplitDict._from_yaml_list(front["dataset_info"]["splits"])  # raises without num_bytes
    assert {name: (s.num_bytes, s.num_examples) for name, s in parsed.items()} == {
        "train": (sizes["train"], 5),
        "test": (sizes["test"], 1),
    }


def test_emrl_bibtex_is_complete() -> None:
    card = _card()
    assert (
        "title         = {{E-MRL}: Cross-view Aligned Evidence-driven Multimodal Reinforcement Learning for "
        "Reliable {3D} Tumor Analysis}," in card
    )
    authors = (
        "author        = {Li, Sijing and Qiu, Zhongwei and Wang, Zhuoya and Yun, Boxiang and Yi, Zhenyu and "
        "Xu, Jianwei and Zhang, Wenqiao and Xia, Yingda and Zhang, Ling},"
    )
    assert authors in card
    assert "booktitle     = {Medical Image Computing and Computer Assisted Intervention (MICCAI)}," in card
    assert "eprint        = {2606.23888}," in card and "year          = {2026}," in card


def test_render_dataset_card_sections() -> None:
    default = _card()
    assert default_label_definitions() in default
    assert "## Results" not in default
    custom = _card(
        label_definitions="Custom labels.", metrics_markdown="| organ | B-Acc |\n| --- | --- |\n| liver | 0.9 |"
    )
    assert "## Label definitions\n\nCustom labels.\n" in custom
    assert default_label_definitions() not in custom
    assert "## Results\n\n| organ | B-Acc |" in custom
    assert "| `frames` | `list<image>` |" in default
    assert "| `location` | `list<string>` |" in default
    for citation in ("2501.04678", "2606.23888", "Bassi"):
        assert citation in default


def test_card_prose_names_the_registered_organs() -> None:
    """The organ list and the location vocabulary come from the registry, so a registered organ is named too."""
    default = _card()
    assert "one row per (case, organ) for liver, pancreas and kidney. Each row" in default
    assert "voxels (liver `1`..`8`, pancreas `head`/`body`/`tail`, kidney `left`/`right`); a sorted list" in default
    register_organ(SPLEEN)
    try:
        with_spleen = _card()
    finally:
        unregister_organ("spleen")
    assert "one row per (case, organ) for liver, pancreas, kidney and spleen. Each row" in with_spleen
    assert "kidney `left`/`right`, spleen: none, the whole organ); a sorted list" in with_spleen
    assert _card() == default


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"version": "v1.0.0", "repo_id": "o/n"}, "is not X.Y.Z"),  # the tag given as the version
        ({"version": "1.0", "repo_id": "o/n"}, "is not X.Y.Z"),  # two parts
        ({"splits": ()}, "splits is empty"),  # no split
        ({"version": "1.0.0"}, "go together"),  # a version without a repo
        ({"repo_id": "my-org/x"}, "go together"),  # a repo without a version
    ],
)
def test_render_dataset_card_bad_arguments_raise(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _card(**overrides)


def test_render_dataset_card_alone_makes_datasets_decode_images(tmp_path: Path) -> None:
    """A shard without Hugging Face schema metadata: the card's features alone make `frames` decode to PIL."""
    buffer = io.BytesIO()
    PILImage.new("L", (4, 4), 77).save(buffer, format="PNG")
    frame_type = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    schema = pa.schema([("case_id", pa.string()), ("frames", frame_type)])
    rows = [{"case_id": "BDMAP_00000001", "frames": [{"bytes": buffer.getvalue(), "path": None}]}]
    (tmp_path / "data").mkdir()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp_path / "data" / "train-00000-of-00001.parquet")
    features = Features({"case_id": Value("string"), "frames": List(Image())}).to_dict()
    card = render_dataset_card(
        table="sft",
        features=features,
        row_counts={"train": {"total": 1}},
        pipeline_version="0.1.0",
        git_sha=None,
        config_fingerprint="0",
        splits=("train",),
    )
    (tmp_path / "README.md").write_text(card)
    loaded = datasets.load_dataset(str(tmp_path), split="train", cache_dir=str(tmp_path / "cache"))
    assert loaded.features["frames"] == List(Image())
    assert loaded[0]["frames"][0].getpixel((0, 0)) == 77


@pytest.mark.parametrize(
    ("licences", "fields"),
    [
        (["CC-BY-NC-4.0"], {"license": "cc-by-nc-4.0"}),
        (["CC-BY-SA-4.0", "CC-BY-NC-SA-4.0"], {"license": ["cc-by-nc-sa-4.0", "cc-by-sa-4.0"]}),
        (["CC-BY-SA-4.0", "LicenseRef-LiTS"], {"license": "other", "license_name": "lits"}),
    ],
)
def test_the_card_names_each_source_licence_and_citation(licences: list[str], fields: dict[str, Any]) -> None:
    sources = [
        {"dataset": f"d{i}", "licence": lic, "citation": f"Author {i} (2024)"} for i, lic in enumerate(licences)
    ]
    card = _card(sources=sources)
    front = _front_matter(card)
    assert {k: front[k] for k in front if k.startswith("license")} == fields
    assert DatasetCard(card).data.to_dict()["license"] == fields["license"]
    for i, lic in enumerate(licences):
        assert f"| `d{i}` | {lic} | Author {i} (2024) |" in card
    assert "cite each source above and E-MRL" in card and "AbdomenAtlas 3.0 terms" not in card
