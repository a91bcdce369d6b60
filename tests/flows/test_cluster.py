"""`build-sft-set` on a real Dask cluster: a scheduler and workers started as separate OS processes on loopback,
addressed by their `tcp://` URL exactly as a remote cluster is.

What a remote cluster has and a `LocalCluster` hides, these tests have too: workers that are not children of the flow,
that get the project and the Prefect API only from their environment (`PYTHONPATH`, `PREFECT_API_URL`), and that can
die without the flow's say. The recipe in `docs/scaling.md` ("Running on a cluster") starts the same processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from distributed import Client
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.settings import get_current_settings

from cli.main import main
from emrl_data.synthetic import demo_specs, write_atlas
from flows.build_sft_set import build_sft_set_flow
from flows.runners import HEAP_ENV, ClusterPreflightError, check_cluster
from tests.loopback import free_port


REPO = Path(__file__).resolve().parents[2]
_SMALL = {"frames": {"frame_size_px": 64, "max_frames": 8}}
# The scheduler hands a single-threaded worker one batch at a time (the default 1.1 would queue a second batch on
# it): a batch never waits on a worker that may die or lag while another is idle. The recipe sets the same.
_SCHEDULER_ENV = {"DASK_DISTRIBUTED__SCHEDULER__WORKER_SATURATION": "1.0"}


def _prefect_env() -> dict[str, str]:
    """The Prefect settings of this (test) process as environment variables: the harness's API URL above all."""
    env = get_current_settings().to_environment_variables(exclude_unset=True)
    assert env.get("PREFECT_API_URL", "").startswith("http://127.0.0.1:"), env  # the harness's server
    return env


@dataclass
class DaskProcesses:
    """A scheduler and its workers, each a separate OS process started here; stopped by PID."""

    address: str
    scheduler: subprocess.Popen
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: Path | None = None

    def start_worker(
        self, name: str, env: dict[str, str], cwd: Path, python_flags: tuple[str, ...] = ()
    ) -> subprocess.Popen:
        """Start `dask worker` (one thread, no nanny: the worker is the process a kill takes down) named `name`."""
        assert self.logs is not None
        cmd = [sys.executable, *python_flags, "-m", "distributed.cli.dask_worker", self.address, "--name", name]
        cmd += ["--nthreads", "1"]
        cmd += ["--no-nanny", "--no-dashboard", "--host", "127.0.0.1", "--death-timeout", "60"]
        cmd += ["--local-directory", str(self.logs / name)]
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        self.workers[name] = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        return self.workers[name]

    def wait_for_workers(self, names: list[str], timeout_s: float = 120.0) -> None:
        """Wait until the scheduler lists every worker in `names` (fail with the logs of those that died)."""
        with Client(self.address, timeout=30) as client:
            deadline = time.monotonic() + timeout_s
            while {w["name"] for w in client.scheduler_info(n_workers=-1)["workers"].values()} < set(names):
                dead = {n: self.workers[n].returncode for n in names if self.workers[n].poll() is not None}
                assert not dead and time.monotonic() < deadline, (dead, self.read_logs())
                time.sleep(0.2)

    def read_logs(self) -> str:
        assert self.logs is not None
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.logs.iterdir()))

    def stop(self) -> None:
        """Stop every process by its PID (SIGTERM, then SIGKILL after 5 s)."""
        procs = [*self.workers.values(), self.scheduler]
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()


def _worker_env() -> dict[str, str]:
    """What every worker of the recipe gets: the project on its path, the flow's Prefect API, the heap settings."""
    return {**os.environ, "PYTHONPATH": str(REPO), **_prefect_env(), **HEAP_ENV}


def start_scheduler(logs: Path, allowed_failures: int = 3) -> DaskProcesses:
    """Start `dask scheduler` on a free loopback port (no workers yet); `allowed_failures` is Dask's setting (the
    default 3: a task is re-sent until it has been on 4 dying workers)."""
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--no-dashboard"]
    log = open(logs / "scheduler.log", "wb")  # noqa: SIM115 (closed with the process)
    env = {**os.environ, **_SCHEDULER_ENV, "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": str(allowed_failures)}
    scheduler = subprocess.Popen(cmd, env=env, cwd=logs, stdout=log, stderr=subprocess.STDOUT)
    return DaskProcesses(f"tcp://127.0.0.1:{port}", scheduler, logs=logs)


def start_cluster(logs: Path, n_workers: int, allowed_failures: int = 3) -> DaskProcesses:
    """Start `dask scheduler` on a free loopback port and `n_workers` workers `w0..`; return once all joined."""
    cluster = start_scheduler(logs, allowed_failures)
    try:
        names = [f"w{i}" for i in range(n_workers)]
        for name in names:
            cluster.start_worker(name, _worker_env(), cwd=logs)
        cluster.wait_for_workers(names)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _tables(out: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for table in ("findings", "sft", "rejections")
        for p in sorted((out / table / "data").glob("*.parquet"))
    }


def _build(atlas: Path, out: Path, cases_per_task: int, **runner: Any) -> tuple[dict[str, Any], str]:
    """Run build-sft-set; return its summary and its flow run id."""
    state = build_sft_set_flow(
        atlas_root=str(atlas),
        output_dir=str(out),
        cases_per_task=cases_per_task,
        max_workers=2,
        config=_SMALL,
        return_state=True,
        **runner,
    )
    return state.result(), str(state.state_details.flow_run_id)


def _every_case_once(out: Path, n_cases: int) -> None:
    """Every case ends in organ rows or a whole-case rejection, never both; no organ row twice."""
    findings = pq.read_table(out / "findings" / "data").select(["case_id", "organ"]).to_pylist()
    rejections = pq.read_table(out / "rejections" / "data").select(["case_id", "organ"]).to_pylist()
    row_cases = {r["case_id"] for r in findings}
    rejected_cases = {r["case_id"] for r in rejections if r["organ"] is None}
    assert len(row_cases | rejected_cases) == n_cases and not row_cases & rejected_cases
    assert len({(r["case_id"], r["organ"]) for r in findings}) == len(findings)


def _task_run_states(flow_run_id: str, n_completed: int, timeout_s: float = 60.0) -> list[str]:
    """The state of every batch task run of a flow run, from the Prefect API (the workers report them as events, which
    the server records asynchronously: wait until `n_completed` are Completed and none is still running)."""
    flow_filter = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=flow_filter)
            states = sorted(str(r.state_type.value) for r in runs if r.name.startswith("curate_batch_task"))
            final = all(s in ("COMPLETED", "FAILED", "CRASHED") for s in states)
            if (states.count("COMPLETED") >= n_completed and final) or time.monotonic() > deadline:
                return states
            time.sleep(0.5)


N_CASES = 8


@pytest.fixture(scope="module")
def reference(prefect_harness, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """A synthetic atlas and the tables the thread runner builds from it on one machine."""
    root = tmp_path_factory.mktemp("cluster")
    write_atlas(root / "atlas", demo_specs(N_CASES))
    summary, _ = _build(root / "atlas", root / "thread", cases_per_task=2)
    assert summary["cases"] == N_CASES and summary["batches_retried"] == 0
    _every_case_once(root / "thread", N_CASES)
    return root / "atlas", _tables(root / "thread")


@pytest.fixture(scope="module")
def two_workers(prefect_harness, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaskProcesses]:
    cluster = start_cluster(tmp_path_factory.mktemp("dask-2"), n_workers=2)
    yield cluster
    cluster.stop()


@pytest.mark.slow
def test_build_sft_set_on_a_dask_cluster_equals_one_machine(
    reference: tuple[Path, dict[str, bytes]], two_workers: DaskProcesses, tmp_path: Path
) -> None:
    """A scheduler and two workers, separate processes reached at `tcp://127.0.0.1:PORT`: the same shards, byte for
    byte, as the thread runner; every case accounted for; every batch a Completed task run in the Prefect API."""
    atlas, thread_tables = reference
    summary, flow_run_id = _build(
        atlas, tmp_path / "dask", cases_per_task=2, task_runner="dask", task_runner_address=two_workers.address
    )
    assert (summary["cases"], summary["cases_resumed_from_store"], summary["batches_retried"]) == (N_CASES, 0, 0)
    assert summary["unexpected_errors"] == 0
    assert thread_tables and _tables(tmp_path / "dask") == thread_tables
    _every_case_once(tmp_path / "dask", N_CASES)
    assert _task_run_states(flow_run_id, n_completed=N_CASES // 2) == ["COMPLETED"] * (N_CASES // 2)
    assert _batches_run_by(two_workers, ["w0", "w1"]) == N_CASES // 2  # in the worker processes, not this one
    assert "batches retried after a lost worker: 0" in (tmp_path / "dask" / "summary.md").read_text()


def _batches_run_by(cluster: DaskProcesses, names: list[str]) -> int:
    """Batches the named workers finished, from their own logs (Prefect's task engine logs each final state)."""
    assert cluster.logs is not None
    return sum((cluster.logs / f"{n}.log").read_text().count("Finished in state Completed()") for n in names)


def _processing_at_removal() -> Callable[..., list[str] | None]:
    """A function for `run_on_scheduler` (defined here, it is pickled by value): the keys the scheduler held as
    processing on `address` when it removed that worker (the transitions out of `processing` its removal caused, from
    the transition log); None while the worker is still registered."""

    def held(dask_scheduler: Any, address: str) -> list[str] | None:
        if address in dask_scheduler.workers:
            return None
        removal = ("handle-worker-cleanup", "remove-worker", "check-worker-ttl")
        log = dask_scheduler.transition_log
        return sorted({str(t.key) for t in log if t.start == "processing" and t.stimulus_id.startswith(removal)})

    return held


class WorkerKiller(threading.Thread):
    """Kill worker `name` (SIGKILL, by PID) once some batch is done and `name` holds batches: mid-run, for sure.

    The batches it held are those the scheduler had as processing on it when it removed it, read from the scheduler's
    transition log (the messages the worker sent before it died are read before its closed connection, so no wait
    is needed for them)."""

    def __init__(self, cluster: DaskProcesses, name: str) -> None:
        super().__init__(daemon=True)
        self.cluster, self.name_to_kill = cluster, name
        self.held: list[str] = []  # the keys of the batches on the worker when it died
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with Client(self.cluster.address, timeout=30) as client:
                address = next(
                    a
                    for a, w in client.scheduler_info(n_workers=-1)["workers"].items()
                    if w["name"] == self.name_to_kill
                )
                while not (client.processing([address])[address] and any(client.has_what().values())):
                    time.sleep(0.02)
                pid = self.cluster.workers[self.name_to_kill].pid
                os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 60  # a hang guard: the scheduler notices the closed connection
                held_when_removed = _processing_at_removal()  # by value: the scheduler cannot import tests/
                while (held := client.run_on_scheduler(held_when_removed, address=address)) is None:
                    assert time.monotonic() < deadline, f"the scheduler never removed {self.name_to_kill}"
                    time.sleep(0.02)
                self.held = held
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            self.error = exc


@pytest.mark.parametrize("allowed_failures", [3, 0])
@pytest.mark.slow
def test_a_lost_worker_costs_a_retry_not_a_case(
    reference: tuple[Path, dict[str, bytes]], tmp_path: Path, allowed_failures: int
) -> None:
    """Two workers, one killed (SIGKILL) while it holds batches: the flow finishes with every case curated exactly
    once, the same shards as one machine, and its summary counts the batches that were run again.

    With Dask's default `allowed-failures` (3) the scheduler re-sends the batches and their task runs end Completed;
    with 0 the scheduler gives up on them (`KilledWorker`), the flow submits them again as new task runs and marks
    the lost ones Crashed."""
    atlas, thread_tables = reference
    cluster = start_cluster(tmp_path / "dask-lost", n_workers=2, allowed_failures=allowed_failures)
    try:
        killer = WorkerKiller(cluster, "w1")
        killer.start()
        summary, flow_run_id = _build(
            atlas, tmp_path / "dask", cases_per_task=1, task_runner="dask", task_runner_address=cluster.address
        )
        killer.join(timeout=30)
        assert killer.error is None and cluster.workers["w1"].wait(timeout=30) == -signal.SIGKILL
        assert killer.held, "the worker was killed while it held batches"
        assert summary["batches_retried"] == len(killer.held)
        assert (
            f"batches retried after a lost worker: {len(killer.held)}"
            in (tmp_path / "dask" / "summary.md").read_text()
        )
        assert summary["cases"] == N_CASES and summary["unexpected_errors"] == 0
        assert _tables(tmp_path / "dask") == thread_tables
        _every_case_once(tmp_path / "dask", N_CASES)
        states = _task_run_states(flow_run_id, n_completed=N_CASES)
        if allowed_failures:  # the re-sent batches kept their task run (same id): all Completed, none left Running
            assert states == ["COMPLETED"] * N_CASES, ({s: states.count(s) for s in set(states)}, killer.held)
        else:  # a new task run per resubmitted batch; the lost ones that had started are Crashed, none left Running
            counts = {s: states.count(s) for s in set(states)}
            assert counts.get("COMPLETED") == N_CASES and set(counts) <= {"COMPLETED", "CRASHED"}, (
                counts,
                killer.held,
            )
            assert states.count("CRASHED") <= len(killer.held)  # those it had started, not those still queued on it
    finally:
        cluster.stop()


def test_an_address_that_does_not_answer_is_named(tmp_path: Path) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"  # a free port: nothing listens there
    with pytest.raises(ClusterPreflightError) as caught:
        check_cluster("dask", address, tmp_path, timeout_s=1)
    message = str(caught.value)
    assert message.startswith(f"the Dask scheduler at {address} does not answer within 1 s") and "\n" not in message


@pytest.mark.slow
def test_the_cli_names_an_unanswering_cluster_in_two_lines(
    reference: tuple[Path, dict[str, bytes]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`emrl build-sft-set --task-runner dask --task-runner-address ...` with nothing there: the check's line and the
    fix, exit 1, no traceback, and no case curated."""
    atlas, _ = reference
    address = f"tcp://127.0.0.1:{free_port()}"
    argv = [
        "build-sft-set",
        str(atlas),
        str(tmp_path / "out"),
        "--task-runner",
        "dask",
        "--task-runner-address",
        address,
    ]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    out, err = capsys.readouterr()
    assert exited.value.code == 1 and "Traceback" not in out + err
    # The last two lines; Prefect's own flow-run log lines come before them, as in a terminal.
    assert err.strip().splitlines()[-2:] == [
        f"emrl build-sft-set: failed: the Dask scheduler at {address} does not answer within 10 s (OSError: Timed out "
        f"trying to connect to {address} after 10 s); check the address and that `dask scheduler` runs there",
        "  fix: correct what the line above names (docs/scaling.md, 'Running on a cluster'), then rerun; no case was curated",
    ]
    assert not list((tmp_path / "out").glob(".work/cases/*.arrow"))


@pytest.mark.slow
def test_a_worker_without_the_project_stops_the_flow_before_any_case(
    reference: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    """A worker whose Python has Dask but not the project (no site `.pth` files, so not the editable install, and
    neither the checkout on PYTHONPATH nor in its cwd): the flow fails naming the worker and the import, and no case
    reaches the case store."""
    atlas, _ = reference
    cluster = start_scheduler(tmp_path / "dask-bare")
    try:
        site_packages = sysconfig.get_paths()["purelib"]
        env = {**_worker_env(), "PYTHONPATH": site_packages}
        cluster.start_worker("bare", env, cwd=tmp_path / "dask-bare", python_flags=("-S",))
        cluster.wait_for_workers(["bare"])
        with pytest.raises(ClusterPreflightError) as caught:
            _build(atlas, tmp_path / "out", cases_per_task=2, task_runner="dask", task_runner_address=cluster.address)
    finally:
        cluster.stop()
    message = str(caught.value)
    assert message.startswith("Dask worker bare (tcp://127.0.0.1:") and "\n" not in message
    assert "cannot import emrl_data (ModuleNotFoundError: No module named 'emrl_data')" in message
    assert list((tmp_path / "out" / ".work" / "cases").iterdir()) == []


@pytest.mark.parametrize("problem", ["output under a file", "output read-only", "atlas not shared"])
@pytest.mark.slow
def test_an_output_or_atlas_the_workers_cannot_use_is_named(
    two_workers: DaskProcesses, tmp_path: Path, problem: str
) -> None:
    """Each worker writes and removes a probe file in the output folder, and looks for the atlas folder. As root
    (CI containers) a 0o500 folder is still writable, so the read-only case then uses a folder under a regular file,
    which no one can create or write (the message says which)."""
    (tmp_path / "a-file").write_text("not a folder")
    out, atlas = tmp_path / "out", tmp_path
    expected = "cannot write to the output folder"
    if problem == "output under a file" or (problem == "output read-only" and os.geteuid() == 0):
        out = tmp_path / "a-file" / "out"
        reason = "(Not a directory)"
    elif problem == "output read-only":
        out.mkdir()
        out.chmod(0o500)
        reason = "(Permission denied)"
    else:
        atlas, expected, reason = tmp_path / "not-here", f"the atlas folder {tmp_path / 'not-here'}", "does not exist"
    with pytest.raises(ClusterPreflightError) as caught:
        check_cluster("dask", two_workers.address, out, read_dirs=(atlas,))
    message = str(caught.value)
    assert message.startswith("Dask worker w") and "\n" not in message
    assert expected in message and reason in message
    if problem != "atlas not shared":
        assert str(out) in message


def test_only_an_existing_dask_cluster_is_checked(tmp_path: Path) -> None:
    assert check_cluster("thread", None, tmp_path) == 0  # the flow's own process: nothing to check
    assert check_cluster("dask", None, tmp_path) == 0  # a local cluster: started from this environment
