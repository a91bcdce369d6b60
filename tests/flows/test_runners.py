"""Task-runner choice (`flows/runners.py`): construction, missing extras, and real runs under the Prefect harness."""

from __future__ import annotations

import inspect
import os
import re
import sys
from pathlib import Path

import pytest
from prefect.task_runners import ProcessPoolTaskRunner, ThreadPoolTaskRunner

from emrl_data.synthetic import demo_specs, write_atlas
from flows.build_sft_set import build_sft_set_flow
from flows.runners import (
    TASK_RUNNERS,
    TaskRunnerUnavailableError,
    make_task_runner,
    runner_available,
    runner_smoke_flow,
)


@pytest.mark.parametrize(
    ("kind", "max_workers", "expected"),
    [
        ("thread", 1, ThreadPoolTaskRunner),  # the default of the flows, smallest size
        ("thread", 8, ThreadPoolTaskRunner),  # I/O-bound sizes above the core count are fine
        ("process", 2, ProcessPoolTaskRunner),  # the CI setting: 2 processes on 2 cores
    ],
)
def test_core_runners(kind: str, max_workers: int, expected: type) -> None:
    runner = make_task_runner(kind, max_workers)
    assert type(runner) is expected
    assert runner._max_workers == max_workers


@pytest.mark.parametrize(
    ("kind", "max_workers", "address", "message"),
    [
        ("threads", 2, None, "is not one of"),  # a typo of a kind
        ("", 2, None, "is not one of"),  # empty
        ("thread", 0, None, "must be an integer >= 1"),  # no workers
        ("process", -1, None, "must be an integer >= 1"),  # negative
        ("process", True, None, "must be an integer >= 1"),  # a bool is not a size
        ("thread", 2, "tcp://sched:8786", "only applies to the dask and ray"),  # an address needs a cluster runner
        ("process", 2, "ray://head:10001", "only applies to the dask and ray"),  # same for processes
    ],
)
def test_bad_choices_are_refused(kind: str, max_workers: int, address: str | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_task_runner(kind, max_workers, address=address)


@pytest.mark.parametrize(
    ("kind", "module", "extra"),
    [
        ("dask", "prefect_dask", '".[dask]"'),  # prefect-dask missing
        ("ray", "prefect_ray", '".[ray]"'),  # prefect-ray missing
    ],
)
def test_missing_extra_names_it(kind: str, module: str, extra: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(TaskRunnerUnavailableError, match=re.escape(f"pip install -e {extra}")) as caught:
        make_task_runner(kind, 2)
    assert module.replace("_", "-") in str(caught.value)
    assert runner_available(kind) is False
    assert runner_available("thread") and runner_available("process")
    assert TASK_RUNNERS == ("thread", "process", "dask", "ray")


def test_thread_runner_runs_in_the_flow_process(prefect_harness) -> None:
    report = runner_smoke_flow(kind="thread", max_workers=2, n_tasks=3, seconds=0.0)
    assert [t["index"] for t in report["tasks"]] == [0, 1, 2]
    assert report["pids"] == [os.getpid()] == [report["flow_pid"]]


def test_process_runner_uses_two_worker_processes(prefect_harness) -> None:
    report = runner_smoke_flow(kind="process", max_workers=2, n_tasks=4, seconds=0.5)
    assert [t["index"] for t in report["tasks"]] == [0, 1, 2, 3]
    assert len(report["pids"]) == 2, report
    assert os.getpid() not in report["pids"]


def _tables(out: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for table in ("findings", "sft", "rejections")
        for p in sorted((out / table / "data").glob("*.parquet"))
    }


@pytest.mark.skipif(
    "task_runner" not in inspect.signature(build_sft_set_flow.fn).parameters,
    reason="build-sft-set has no task_runner parameter yet",
)
def test_build_sft_set_with_process_runner_equals_threads(prefect_harness, tmp_path: Path) -> None:
    atlas = tmp_path / "atlas"
    write_atlas(atlas, demo_specs(4))
    small = {"frames": {"frame_size_px": 64, "max_frames": 8}}
    outputs = {}
    for kind in ("thread", "process"):
        outputs[kind] = tmp_path / kind
        summary = build_sft_set_flow(
            atlas_root=str(atlas),
            output_dir=str(outputs[kind]),
            batch_size=2,
            max_workers=2,
            config=small,
            task_runner=kind,
        )
        assert summary["cases"] == 4 and summary["unexpected_errors"] == 0
    thread_tables, process_tables = _tables(outputs["thread"]), _tables(outputs["process"])
    assert thread_tables and process_tables == thread_tables  # byte-identical shards whichever runner curated


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dask", "ray"])
def test_cluster_runner_on_a_local_cluster(prefect_harness, kind: str) -> None:
    if not runner_available(kind):
        pytest.skip(f"the {kind} extra is not installed (pip install -e '.[{kind}]')")
    report = runner_smoke_flow(kind=kind, max_workers=2, n_tasks=4, seconds=0.2)
    assert [t["index"] for t in report["tasks"]] == [0, 1, 2, 3]
    assert report["pids"] and os.getpid() not in report["pids"]
