"""`emrl build-rl-hardset --dialect openai` (the real CLI, flow and Prefect) against a server that echoes the key
everywhere and dies mid-run, then a rerun against a healthy one: every row is predicted exactly once, and the key is in
no output file, log line or Prefect database."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cli.main import main
from tests.inference.helpers import build_small_sft_set
from tests.inference.hostile_server import TEXT, HostileServer


KEY = "sk-e2e-9b7d2a41f0"


def _rows(folder: Path) -> list[dict]:
    return [r for p in sorted(folder.glob("*.parquet")) for r in pq.read_table(p).to_pylist()]


@pytest.mark.slow
def test_dead_server_then_rerun_predicts_every_row_once_and_never_writes_the_key(
    prefect_harness, tmp_path_factory, monkeypatch, capsys, caplog
) -> None:
    out = build_small_sft_set(tmp_path_factory, frame_px=32)
    n_rows = len(_rows(out / "sft" / "data"))
    monkeypatch.setenv("OPENAI_API_KEY", KEY)

    options = "--endpoint-model tiny --dialect openai --max-new-tokens 32 --bootstrap 20".split()

    def argv(url: str) -> list[str]:
        return ["build-rl-hardset", str(out / "sft"), str(out), "--endpoint", url, *options]

    with HostileServer(dies_after=3) as dying:  # the probe's 2 answers, then 1 row, then it dies
        dying.faults.extend(["echo:503", "echo:500"])  # the key in error bodies, headers and reason phrases
        dying.always = "model_echo"
        with pytest.raises(SystemExit) as first:
            main(argv(dying.url))
        port = dying.port
    err = capsys.readouterr().err
    assert first.value.code == 1
    assert f"{n_rows - 1} of {n_rows} row(s) could not be predicted" in err
    assert (
        f"fix: rerun the same command: it sends only these {n_rows - 1} row(s) again and keeps the 1 predicted" in err
    )

    with HostileServer(port=port) as healthy:
        healthy.always = "content_echo"
        main(argv(healthy.url))
    rows = [(d, cap) for d, cap in dying.answered + healthy.answered if cap == 32]  # the probe asks for 16 tokens
    assert len(rows) == len({d for d, _ in rows}) == n_rows  # every row answered exactly once
    predictions = _rows(out / "predictions" / "data")
    assert len(predictions) == n_rows and all(p["inference_error"] is None for p in predictions)
    assert sorted({p["prediction"] for p in predictions}) == sorted({TEXT, f"{TEXT} ***"})
    summary = json.loads((out / "rl_hardset" / "summary.json").read_text())
    assert summary["retried_errors"] == n_rows - 1 and summary["failed_predictions"] == 0

    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL, PREFECT_HOME

    leaks = [p for p in out.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]
    db = Path(str(PREFECT_API_DATABASE_CONNECTION_URL.value()).split("///")[-1])
    home = Path(PREFECT_HOME.value())
    assert db.is_file() and db.stat().st_size > 0  # the harness's SQLite database, searched below
    stores = [p for p in [db, *db.parent.glob("*"), *home.rglob("*")] if p.is_file()]
    leaks += [p for p in stores if KEY.encode() in p.read_bytes()]
    assert leaks == []
    assert KEY not in capsys.readouterr().err and KEY not in caplog.text
