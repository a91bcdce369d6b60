"""Task-runner choice (`flows/runners.py`): construction, missing extras, and real runs under the Prefect harness."""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from prefect.task_runners import ProcessPoolTaskRunner, ThreadPoolTaskRunner

from emrl_data.synthetic import demo_specs, write_atlas
from flows.build_sft_set import build_sft_set_flow
from flows.runners import (
    _EXTERNAL_RUNNERS,
    HEAP_ENV,
    TASK_RUNNERS,
    TaskRunnerUnavailableError,
    _runner_class,
    dask_runner_kwargs,
    make_task_runner,
    ray_runner_kwargs,
    reuse_heap,
    reuse_heap_in_worker,
    runner_smoke_flow,
)


def runner_available(kind: str) -> bool:
    """Return whether `make_task_runner(kind, ...)` can build this runner here (its extra is installed).

    Tests only: the flow itself raises `TaskRunnerUnavailableError` naming the extra when one is missing."""
    if kind not in TASK_RUNNERS:
        raise ValueError(f"task_runner={kind!r} is not one of {TASK_RUNNERS}.")
    if kind not in _EXTERNAL_RUNNERS:
        return True
    try:
        _runner_class(kind)
    except TaskRunnerUnavailableError:
        return False
    return True


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
    assert isinstance(runner, expected)
    assert runner._max_workers == max_workers
    if kind == "process":
        assert runner._initializer is reuse_heap_in_worker  # every worker process reuses its heap from the start
        assert type(runner.duplicate()) is ProcessPoolTaskRunner
        assert runner.duplicate()._initializer is reuse_heap_in_worker


def test_cluster_runner_arguments_carry_the_heap_settings() -> None:
    assert HEAP_ENV == {
        "MALLOC_ARENA_MAX": "1",
        "MALLOC_MMAP_MAX_": "0",
        "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1),
        "MALLOC_TOP_PAD_": str(64 * 2**20),
    }
    local = dask_runner_kwargs(3, None)["cluster_kwargs"]
    assert (local["n_workers"], local["threads_per_worker"], local["processes"], local["host"]) == (
        3,
        1,
        True,
        "127.0.0.1",
    )
    assert HEAP_ENV.items() <= local["env"].items()  # overrides Dask's own MALLOC_TRIM_THRESHOLD_=65536
    assert dask_runner_kwargs(3, "tcp://sched:8786") == {"address": "tcp://sched:8786"}
    ray_env = {"env_vars": HEAP_ENV, "worker_process_setup_hook": reuse_heap}  # reuse_heap runs in every Ray worker
    assert ray_runner_kwargs(2, None) == {
        "init_kwargs": {"runtime_env": ray_env, "num_cpus": 2, "include_dashboard": False}
    }
    assert ray_runner_kwargs(2, "ray://head:10001") == {
        "address": "ray://head:10001",
        "init_kwargs": {"runtime_env": ray_env},
    }


_PAGE_FAULT_PROBE = """
import json, resource, sys
import numpy as np
from flows.runners import reuse_heap
applied = reuse_heap() if sys.argv[1] == "reuse" else False
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = np.ones(96 * 2**20, dtype=np.uint8)  # 96 MiB, above glibc's mmap threshold
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del block
print(json.dumps({"applied": applied, "faults": faults}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
@pytest.mark.slow
def test_reuse_heap_stops_refaulting_a_freed_buffer() -> None:
    """A 96 MiB buffer freed and allocated again: the default malloc unmaps it and faults its pages in each time;
    after `reuse_heap` the second and third allocations reuse the pages the first one faulted in."""

    def probe(mode: str) -> dict:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        out = subprocess.run([sys.executable, "-c", _PAGE_FAULT_PROBE, mode], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    default, reused = probe("default"), probe("reuse")
    # fault counts depend on the page size (numpy asks for transparent huge pages), so compare them with each other
    first = default["faults"][0]
    assert default["applied"] is False and first > 0 and min(default["faults"]) >= first // 2  # faults every time
    assert reused["applied"] is True and reused["faults"][0] >= first // 2  # the first allocation faults in ...
    assert max(reused["faults"][1:]) <= first // 20  # ... and the later ones reuse those pages


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
    assert all(t["heap_reused"] for t in report["tasks"])  # applied to the flow process when the runner started


@pytest.mark.slow
def test_process_runner_uses_two_worker_processes(prefect_harness, tmp_path: Path) -> None:
    # The first two tasks wait for each other in a rendezvous folder: two worker processes, whatever the load.
    report = runner_smoke_flow(kind="process", max_workers=2, n_tasks=4, seconds=0.0, rendezvous_dir=str(tmp_path))
    assert [t["index"] for t in report["tasks"]] == [0, 1, 2, 3]
    assert len(report["pids"]) == 2, report
    assert os.getpid() not in report["pids"]
    assert all(t["heap_reused"] for t in report["tasks"])  # the pool's initializer ran in each worker


def _tables(out: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for table in ("findings", "sft", "rejections")
        for p in sorted((out / table / "data").glob("*.parquet"))
    }


_SMALL = {"frames": {"frame_size_px": 64, "max_frames": 8}}


def _build(atlas: Path, out: Path, kind: str) -> dict[str, bytes]:
    summary = build_sft_set_flow(
        atlas_root=str(atlas), output_dir=str(out), cases_per_task=2, max_workers=2, config=_SMALL, task_runner=kind
    )
    assert summary["cases"] == 4 and summary["unexpected_errors"] == 0
    assert summary["cases_resumed_from_store"] == 0  # every case was curated by this runner's workers
    assert summary["cases_per_s"] > 0 and f"({summary['cases_per_s']} cases/s)" in (out / "summary.md").read_text()
    return _tables(out)


@pytest.fixture(scope="module")
def thread_build(prefect_harness, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """A 4-case atlas and the tables the thread runner builds from it (the reference of the other runners)."""
    root = tmp_path_factory.mktemp("runners")
    write_atlas(root / "atlas", demo_specs(4))
    return root / "atlas", _build(root / "atlas", root / "thread", "thread")


@pytest.mark.skipif(
    "task_runner" not in inspect.signature(build_sft_set_flow.fn).parameters,
    reason="build-sft-set has no task_runner parameter yet",
)
@pytest.mark.parametrize("kind", ["process", "dask", "ray"])
@pytest.mark.slow
def test_build_sft_set_on_worker_processes_equals_threads(
    thread_build: tuple[Path, dict[str, bytes]], tmp_path: Path, kind: str
) -> None:
    """Scale-out on a real engine: a 2-process pool, a Dask LocalCluster of 2 worker processes on loopback, and (where
    the ray extra is installed: the manual check of docs/scaling.md) a local Ray of 2 CPUs write the same shards,
    byte for byte, as the thread runner. A Dask cluster of separate processes: tests/flows/test_cluster.py."""
    if kind == "ray" and not runner_available(kind):
        pytest.skip("the ray extra is not in the dev extra (docs/scaling.md, 'Ray: a manual check')")
    if not runner_available(kind):
        pytest.fail(f"the {kind} runner must be installed by the dev extra")
    atlas, thread_tables = thread_build
    tables = _build(atlas, tmp_path / kind, kind)
    assert thread_tables and tables == thread_tables


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dask", "ray"])
def test_cluster_runner_on_a_local_cluster(prefect_harness, kind: str) -> None:
    if kind == "ray" and not runner_available(kind):
        pytest.skip(f"the {kind} extra is not installed (pip install -e '.[{kind}]')")
    report = runner_smoke_flow(kind=kind, max_workers=2, n_tasks=4, seconds=0.2)
    assert [t["index"] for t in report["tasks"]] == [0, 1, 2, 3]
    assert report["pids"] and os.getpid() not in report["pids"]
    # the workers started with the heap settings and applied them (Nanny env + client.run / runtime_env)
    assert all(t["heap_reused"] and t["malloc_arena_max"] == "1" for t in report["tasks"]), report
