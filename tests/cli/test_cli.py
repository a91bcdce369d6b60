"""The `emrl` command line."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from cli.commands.layouts import describe as describe_layouts
from cli.main import main
from emrl_data.reading.layout import layout_named
from emrl_data.text.report import render_evidence, render_findings, render_impression, render_report
from emrl_data.types import Organ


def _positive_report(long_axis_mm: float, location: list[str], k: int) -> str:
    kwargs = dict(has_lesion=True, lesion_count=1, long_axis_mm=long_axis_mm, location=location, attenuation="hypo")
    findings = render_findings(Organ.LIVER, short_axis_mm=10.0, volume_mm3=900.0, **kwargs)
    return render_report(findings, render_impression(Organ.LIVER, **kwargs), render_evidence(k, [1, 2, 30, 40]))


def test_eval_writes_tables_from_raw_predictions(tmp_path: Path, capsys) -> None:
    truth = {"organ": "liver", "attenuation": "hypo", "location": ["5"], "key_slice_frame": 7}
    rows = [
        # a perfect positive (15 mm: the <= 2 cm bin)
        {**truth, "has_lesion": True, "long_axis_mm": 15.0, "prediction": _positive_report(15.0, ["5"], 7)},
        # a positive with the wrong location and a K-Hit miss (30 mm: the > 2 cm bin)
        {**truth, "has_lesion": True, "long_axis_mm": 30.0, "prediction": _positive_report(30.0, ["6"], 12)},
        # a true negative, and a false positive
        {
            **truth,
            "has_lesion": False,
            "long_axis_mm": None,
            "location": [],
            "attenuation": None,
            "key_slice_frame": None,
            "prediction": render_report("No focal liver lesion is identified.", "No liver tumor.", None),
        },
        {
            **truth,
            "has_lesion": False,
            "long_axis_mm": None,
            "location": [],
            "attenuation": None,
            "key_slice_frame": None,
            "prediction": _positive_report(20.0, ["5"], 3),
        },
    ]
    path = tmp_path / "preds.parquet"
    pl.DataFrame(rows).write_parquet(path)

    main(["eval", str(path), "--out", str(tmp_path / "eval"), "--bootstrap", "50"])

    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    text = json.dumps(metrics)
    assert (tmp_path / "eval" / "metrics.md").is_file() and (tmp_path / "eval" / "metrics.png").is_file()
    assert "Table 1" in capsys.readouterr().out
    # Sen 2/2, Spec 1/2, B-Acc 0.75; location 1/2, K-Hit 1/2, size 2/2.
    assert '"sen"' in text
    liver1 = metrics["table1"]["liver"]
    assert liver1["sen"]["value"] == 1.0 and liver1["spec"]["value"] == 0.5 and liver1["bacc"]["value"] == 0.75
    liver2 = metrics["table2"]["liver"]
    assert liver2["size"]["value"] == 1.0 and liver2["location"]["value"] == 0.5 and liver2["k_hit"]["value"] == 0.5


@pytest.mark.slow
def test_publish_command_to_a_local_folder_and_refusal_to_move_a_tag(prefect_harness, tmp_path: Path, capsys) -> None:

    from emrl_data.tables.table_folder import write_table

    rows = [{"case_id": "BDMAP_00000001", "organ": None, "step": "load", "reason": "corrupt_gzip", "detail": "x"}]
    rows = [row | layout_named("abdomenatlas").source.columns(row["case_id"]) for row in rows]
    provenance = {"pipeline_version": "0.1.0", "git_sha": None, "config_fingerprint": "f"}
    table = write_table("rejections", {"train": rows}, tmp_path / "out", provenance=provenance)

    main(["publish", str(table), "emrl/rejections", "1.2.3", "--local-root", str(tmp_path / "pub")])

    release = tmp_path / "pub" / "emrl" / "rejections" / ".tags" / "v1.2.3"
    assert (release / "README.md").is_file() and (release / "data" / "train-00000-of-00001.parquet").is_file()
    # The same content again: a no-op that says so (exit 0).
    main(["publish", str(table), "emrl/rejections", "1.2.3", "--local-root", str(tmp_path / "pub")])
    capsys.readouterr()
    # Other content under the same version: refused in a short message, the tag is never moved.
    changed = write_table(
        "rejections", {"train": [{**rows[0], "detail": "y"}]}, tmp_path / "out2", provenance=provenance
    )
    with pytest.raises(SystemExit) as exited:
        main(["publish", str(changed), "emrl/rejections", "1.2.3", "--local-root", str(tmp_path / "pub")])
    err = capsys.readouterr().err
    assert exited.value.code == 1 and "v1.2.3" in err.splitlines()[-2] and "Traceback" not in err


def test_layouts_names_each_licence_and_the_labels_a_layout_ignores() -> None:
    text = describe_layouts()
    panorama = text.split("\n\n")[4]
    assert panorama.splitlines() == [
        "panorama: PANORAMA (pancreatic ductal adenocarcinoma)",
        "  annotates: pancreas",
        "  labels:    manual_labels/<id>.nii.gz (panorama_labels, or --labels DIR): 1 PDAC (tumor), 2 veins (ignored), "
        "3 arteries (ignored), 4 pancreas, 5 pancreatic duct (ignored), 6 common bile duct (ignored)",
        "  licence:   CC-BY-NC-4.0 (the PANORAMA Zenodo batches and the panorama_labels repository)",
        "  cite:      Alves et al., The PANORAMA study protocol: pancreatic cancer diagnosis, radiologists meet AI, "
        "Zenodo 10.5281/zenodo.10599559 (2024)",
        "  run:       emrl build-sft-set PANORAMA/ out/ --labels panorama_labels/manual_labels",
    ]
    assert [block.split(":")[0] for block in text.split("\n\n")] == [
        "msd-task03",
        "msd-task07",
        "kits23",
        "lits",
        "panorama",
        "abdomenatlas",
    ]
