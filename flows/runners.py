"""Task-runner choice per flow run: `thread`, `process`, `dask` or `ray` (scale-out).

The flows take a `task_runner` parameter (a plain string, so it fits a deployment's parameter schema and `-p
task_runner='"process"'`) and build the runner with `make_task_runner` inside the flow body::

    with make_task_runner(task_runner, max_workers) as runner:
        futures = [runner.submit(curate_batch_task, parameters={...}) for batch in batches]

- `thread` (default): `ThreadPoolTaskRunner`; right for I/O (NIfTI reads, Hub uploads) and for the GIL-releasing
  parts of curation (isal inflate, cc3d, OpenCV).
- `process`: `ProcessPoolTaskRunner` (Prefect core, spawn start method); true CPU parallelism on one machine. Task
  arguments and results must pickle, and every worker process talks to the Prefect API, so run it against a real
  server (`PREFECT_API_URL`) or the test harness, never in ephemeral mode (each child would start its own temporary
  server: docs/operations.md#the-ephemeral-mode-trap).
- `dask`: `prefect_dask.DaskTaskRunner` (extra `pip install -e ".[dask]"`): a local cluster of `max_workers`
  single-threaded worker processes, or an existing scheduler with `address="tcp://host:8786"`.
- `ray`: `prefect_ray.RayTaskRunner` (extra `pip install -e ".[ray]"`): a local Ray with `max_workers` CPUs, or an
  existing cluster with `address="ray://head:10001"`.

Heap reuse: every worker keeps its freed heap instead of handing it back to the OS, so the next case's
1.5 GB of inflated volumes land in pages that are already mapped (first-touch page faults cost more than the
inflate itself on a VM). `reuse_heap` sets glibc's malloc through `mallopt` and is applied when the runner starts its
workers: in the flow process for `thread` (with one malloc arena: a worker thread in its own arena gets every big
buffer from a fresh `mmap` whatever the other settings), as the process pool's `initializer` for `process`, through
the Nanny's environment plus `client.run` for `dask`, and through `runtime_env` (environment variables and a worker
setup hook) for `ray`.
`HEAP_ENV` holds the same settings as `MALLOC_*` variables for workers started by hand (`dask worker`, `ray start`).

Runners that leave the flow's process (`process`, `dask`, `ray`) need the case store and any persisted task results
on storage every worker can reach: see `docs/scaling.md`.

An existing cluster is checked by `check_cluster` before any case is sent to it (the address answers, every worker
imports the project and can write the output folder), and a batch lost with its worker is counted (`settle_future`)
or resubmitted (`is_lost_worker_error`): docs/scaling.md, "Running on a cluster".

`python -m flows.runners --kind dask --address tcp://sched:8786` runs a tiny smoke flow on a runner and prints which
hosts and processes ran its tasks: check a cluster with it before sending it the atlas.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import importlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.settings import get_current_settings
from prefect.task_runners import ProcessPoolTaskRunner, TaskRunner, ThreadPoolTaskRunner


logger = logging.getLogger(__name__)

TASK_RUNNERS = ("thread", "process", "dask", "ray")
# kind -> (module, class, extra that installs it)
_EXTERNAL_RUNNERS = {
    "dask": ("prefect_dask", "DaskTaskRunner", "dask"),
    "ray": ("prefect_ray", "RayTaskRunner", "ray"),
}


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -2, -4, -8
HEAP_TRIM_THRESHOLD_BYTES = 2**31 - 1  # the largest value mallopt takes (an int): never trim the heap top
HEAP_TOP_PAD_BYTES = 64 * 2**20  # grow the heap in 64 MiB steps (fewer brk calls for 78-157 MB buffers)
# The same settings as environment variables, read by glibc when a process starts (workers started by hand, Dask's
# Nanny, Ray's runtime_env). They also override Dask's default MALLOC_TRIM_THRESHOLD_=65536, which trims eagerly.
HEAP_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(HEAP_TRIM_THRESHOLD_BYTES),
    "MALLOC_TOP_PAD_": str(HEAP_TOP_PAD_BYTES),
}
_heap_reused = False


class TaskRunnerUnavailableError(ImportError):
    """The chosen task runner's integration package is not installed."""


def reuse_heap_in_worker() -> None:
    """The process pool's initializer: `reuse_heap` with its defaults (an initializer returns nothing)."""
    reuse_heap()


def reuse_heap(single_arena: bool = True) -> bool:
    """Make this process's malloc keep and reuse its freed memory (glibc `mallopt`); call it at worker start.

    Sets: no `mmap` for big blocks (`M_MMAP_MAX=0`: they come from the heap and go back to it when freed), never
    trim the heap top (`M_TRIM_THRESHOLD`), grow it in `HEAP_TOP_PAD_BYTES` steps, and with `single_arena` at most
    one arena (`M_ARENA_MAX=1`), so threads started afterwards share the main heap; a thread in an arena of its own
    gets every block above 64 MiB from a fresh `mmap` whatever the rest says. The price: the process keeps its peak
    heap (about one case's working set) mapped until it exits, which is what a worker that curates case after case
    wants. Safe to call more than once.

    Args:
        single_arena: also limit malloc to one arena (right for thread workers and for worker processes that run
            tasks in threads, e.g. Dask's).

    Returns:
        True when the settings were applied; False where malloc is not glibc's (macOS, musl), nothing changed.
    """
    global _heap_reused
    libc_path = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(libc_path)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # mallopt's parameter numbers are glibc's
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = [(_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD_BYTES), (_M_TOP_PAD, HEAP_TOP_PAD_BYTES)]
    if single_arena:
        settings.append((_M_ARENA_MAX, 1))
    applied = all(mallopt(param, value) == 1 for param, value in settings)
    _heap_reused = _heap_reused or applied
    return applied


def heap_reused() -> bool:
    """Return whether `reuse_heap` has applied its settings in this process."""
    return _heap_reused


def make_task_runner(kind: str, max_workers: int, *, address: str | None = None) -> TaskRunner:
    """Build the task runner of a flow run.

    Args:
        kind: one of `TASK_RUNNERS`: `"thread"`, `"process"`, `"dask"` or `"ray"`.
        max_workers: tasks run at once: threads (`thread`), processes (`process`), local Dask workers of one thread
            each (`dask` without `address`), CPUs of a local Ray (`ray` without `address`). Must be >= 1.
        address: only for `dask` and `ray`: an existing cluster (`tcp://scheduler:8786` for Dask,
            `ray://head:10001` for Ray); None starts a local one sized by `max_workers`, stopped with the runner.

    Returns:
        An unstarted task runner; use it as a context manager (`with runner: runner.submit(...)`) or pass it to
        `@flow(task_runner=...)` / `flow.with_options(task_runner=...)`.

    Raises:
        ValueError: on an unknown kind, `max_workers < 1`, or an `address` with `thread`/`process`.
        TaskRunnerUnavailableError: `dask`/`ray` without their extra installed; the message names the extra.
    """
    if kind not in TASK_RUNNERS:
        raise ValueError(f"task_runner={kind!r} is not one of {TASK_RUNNERS}.")
    if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
        raise ValueError(f"max_workers={max_workers!r} must be an integer >= 1.")
    if address is not None and kind not in _EXTERNAL_RUNNERS:
        raise ValueError(f"address={address!r} only applies to the dask and ray runners, not {kind!r}.")
    if kind == "thread":
        return HeapReuseThreadPoolTaskRunner(max_workers=max_workers)
    if kind == "process":
        return ProcessPoolTaskRunner(max_workers=max_workers, initializer=reuse_heap_in_worker)
    if kind == "dask":
        return _dask_runner_class()(**dask_runner_kwargs(max_workers, address))
    return _runner_class(kind)(**ray_runner_kwargs(max_workers, address))


def dask_runner_kwargs(max_workers: int, address: str | None) -> dict[str, Any]:
    """Arguments of the Dask runner: a local cluster of single-threaded worker processes whose Nannies start them
    with `HEAP_ENV`, or an existing scheduler (there the worker plugin applies `reuse_heap`)."""
    if address is not None:
        return {"address": address}
    cluster = {
        "n_workers": max_workers,
        "threads_per_worker": 1,
        "processes": True,
        "host": "127.0.0.1",  # a local cluster listens on loopback only
        "dashboard_address": None,  # no dashboard port (and no bokeh needed)
        # the workers' environment: the heap settings and this process's Prefect settings (API URL, result storage),
        # as the process pool passes them, so workers report to the flow's API instead of starting their own server
        "env": {**get_current_settings().to_environment_variables(exclude_unset=True), **HEAP_ENV},
    }
    return {"cluster_kwargs": cluster}


def ray_runner_kwargs(max_workers: int, address: str | None) -> dict[str, Any]:
    """Arguments of the Ray runner: every worker process starts with `HEAP_ENV` and runs `reuse_heap` before its first
    task (the job's `runtime_env`)."""
    # env_vars: glibc reads them when the worker process starts; the setup hook runs `reuse_heap` in each worker
    # before its first task (so `heap_reused()` is true there, as on the other runners)
    runtime_env = {"env_vars": dict(HEAP_ENV), "worker_process_setup_hook": reuse_heap}
    init_kwargs: dict[str, Any] = {"runtime_env": runtime_env}
    if address is not None:
        return {"address": address, "init_kwargs": init_kwargs}
    return {"init_kwargs": {**init_kwargs, "num_cpus": max_workers, "include_dashboard": False}}


class ClusterPreflightError(RuntimeError):
    """A cluster the flow cannot use: no answer at its address, a worker without the project, an unwritable output."""


def check_cluster(
    kind: str, address: str | None, output_dir: Path, read_dirs: tuple[Path, ...] = (), timeout_s: float = 10.0
) -> int:
    """Check an existing cluster before any case is sent to it; raise a one-line error naming the first problem.

    Only `dask` with an `address` is checked (a local cluster is built from this process's own environment; Ray is
    not installed here, see docs/scaling.md). Checks, in order: the scheduler answers within `timeout_s`; at least
    one worker has joined within `timeout_s`; then on every worker: `emrl_data` and `flows.build_sft_set` import,
    every folder of `read_dirs` (the atlas) exists, and a probe file can be written to and removed from
    `output_dir` (which this process has created: a worker that does not see it is not on the shared storage).

    Returns:
        The number of workers checked (0 when there was nothing to check).

    Raises:
        ClusterPreflightError: the message names the address or the worker and the problem.
    """
    if kind != "dask" or address is None:
        return 0
    # lazy: distributed is the optional `dask` extra (make_task_runner checked it is installed)
    from distributed import Client

    try:
        client = Client(address, timeout=timeout_s, set_as_default=False)
    except (OSError, TimeoutError) as exc:
        raise ClusterPreflightError(
            f"the Dask scheduler at {address} does not answer within {timeout_s:g} s ({type(exc).__name__}: {exc}); "
            "check the address and that `dask scheduler` runs there"
        ) from None
    with client:
        workers = _wait_for_a_worker(client, address, timeout_s)
        problems = client.run(_worker_probe(), str(output_dir), [str(p) for p in read_dirs])
    for worker_address, found in sorted(problems.items()):
        if found:
            name = workers.get(worker_address, {}).get("name", worker_address)
            raise ClusterPreflightError(f"Dask worker {name} ({worker_address}): {found[0]}")
    return len(problems)


def _wait_for_a_worker(client: Any, address: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not (workers := client.scheduler_info(n_workers=-1)["workers"]):
        if time.monotonic() > deadline:
            raise ClusterPreflightError(f"the Dask scheduler at {address} has no worker after {timeout_s:g} s")
        time.sleep(0.2)
    return workers


def _worker_probe() -> Any:
    """The check run on every worker, built here so that it is pickled by value: it must run on a worker that cannot
    import this module (the very problem it reports)."""

    def probe(output_dir: str, read_dirs: list[str]) -> list[str]:
        import importlib  # lazy: the probe is pickled by value: it must not depend on this module
        import os  # lazy: see importlib
        import socket  # lazy: see importlib
        import uuid  # lazy: see importlib

        for module in ("emrl_data", "flows.build_sft_set"):
            try:
                importlib.import_module(module)
            except Exception as exc:  # noqa: BLE001 (any import failure is the finding)
                return [
                    f"cannot import {module} ({type(exc).__name__}: {exc}): install the project on every worker "
                    "(pip install -e '.[dask]') or put its checkout on PYTHONPATH"
                ]
        for folder in read_dirs:
            if not os.path.isdir(folder):
                return [f"the atlas folder {folder} does not exist there: it must be on storage every worker sees"]
        probe_file = os.path.join(output_dir, f".probe-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex}")
        try:
            with open(probe_file, "wb") as f:
                f.write(b"probe")
            os.remove(probe_file)
        except OSError as exc:
            return [
                f"cannot write to the output folder {output_dir} ({exc.strerror or exc}): it must be on storage "
                "every worker sees and can write"
            ]
        return []

    return probe


def is_lost_worker_error(exc: BaseException) -> bool:
    """Return whether a task future failed because the cluster lost the workers that ran it, not because the task
    raised: Dask's `KilledWorker`, raised once the task was on more dying workers than the scheduler's
    `distributed.scheduler.allowed-failures` (3 by default) allows. The flow may submit such a batch again."""
    return type(exc).__name__ == "KilledWorker" and type(exc).__module__.startswith("distributed")


def settle_future(future: Any) -> int:
    """Release a consumed task future on its cluster and return how many times the cluster ran its task again.

    For a Dask future: the times the scheduler re-sent the task because the worker that ran (or held) it was lost
    (the task's `suspicious` count; 0 when no worker was lost). Releasing it right after its result is read keeps a
    later lost worker from recomputing a batch whose result the flow already has. For other runners: 0.
    """
    wrapped = getattr(future, "wrapped_future", None)
    if wrapped is None or not hasattr(wrapped, "client") or not hasattr(wrapped, "key"):
        return 0
    count = wrapped.client.run_on_scheduler(_suspicious_count(), wrapped.key)
    wrapped.release()
    return int(count)


def _suspicious_count() -> Any:
    """The scheduler-side lookup of `settle_future`, built here so that it is pickled by value (the scheduler does
    not need the project installed)."""

    def suspicious(key: Any, dask_scheduler: Any = None) -> int:
        task = dask_scheduler.tasks.get(key)
        return 0 if task is None else task.suspicious

    return suspicious


class HeapReuseThreadPoolTaskRunner(ThreadPoolTaskRunner):
    """`ThreadPoolTaskRunner` that applies `reuse_heap(single_arena=True)` to the flow process when it starts."""

    def __enter__(self) -> HeapReuseThreadPoolTaskRunner:
        reuse_heap(single_arena=True)
        super().__enter__()
        return self


def _dask_runner_class() -> type[TaskRunner]:
    base: Any = _runner_class("dask")

    class HeapReuseDaskTaskRunner(base):  # type: ignore[misc, valid-type]
        """`DaskTaskRunner` that runs `reuse_heap` on every worker of the cluster when it starts (a local cluster's
        workers also start with `HEAP_ENV`; on a cluster started by hand, export `HEAP_ENV` on the workers so that
        workers joining later get it too)."""

        def __enter__(self) -> Any:
            super().__enter__()
            self.client.run(reuse_heap, True)
            return self

    return HeapReuseDaskTaskRunner


def _runner_class(kind: str) -> type[TaskRunner]:
    module_name, class_name, extra = _EXTERNAL_RUNNERS[kind]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskRunnerUnavailableError(
            f"task_runner={kind!r} needs the {module_name.replace('_', '-')} integration, which is not installed "
            f'({exc}). Install the extra in the project venv: pip install -e ".[{extra}]"'
        ) from exc
    return getattr(module, class_name)


def _meet(rendezvous_dir: str, peers: int, timeout_s: float = 120.0) -> None:
    """Leave this process's id in `rendezvous_dir`, then wait until `peers` distinct processes have left theirs.

    Makes "the tasks ran in N processes" a fact the tasks establish, not a race won by sleeping long enough.
    """
    folder = Path(rendezvous_dir)
    (folder / str(os.getpid())).touch()
    deadline = time.monotonic() + timeout_s
    while len(list(folder.iterdir())) < peers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(list(folder.iterdir()))} of {peers} worker processes met in {timeout_s} s")
        time.sleep(0.01)


@task(cache_policy=NO_CACHE)
def where_task(index: int, seconds: float, rendezvous_dir: str | None = None, peers: int = 0) -> dict[str, Any]:
    """Sleep `seconds` (or meet `peers` other worker processes in `rendezvous_dir`), then return where this task ran
    (host, process id), its index and whether the worker's heap is set for reuse (`heap_reused`, and the
    `MALLOC_ARENA_MAX` it was started with)."""
    if rendezvous_dir is not None:
        _meet(rendezvous_dir, peers)
    time.sleep(seconds)
    return {
        "index": index,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "heap_reused": heap_reused(),
        "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX"),
    }


@flow(name="task-runner-smoke")
def runner_smoke_flow(
    kind: str = "thread",
    max_workers: int = 2,
    n_tasks: int = 4,
    seconds: float = 0.2,
    address: str | None = None,
    rendezvous_dir: str | None = None,
) -> dict[str, Any]:
    """Run `n_tasks` tiny tasks on the chosen runner and report which hosts and processes ran them.

    Args:
        kind: the task runner, see `make_task_runner`.
        max_workers: the runner's size, see `make_task_runner`.
        n_tasks: tasks to submit.
        seconds: how long each task sleeps.
        address: an existing Dask/Ray cluster, see `make_task_runner`.
        rendezvous_dir: an empty folder on a file system every worker sees: each task first waits there until
            `min(n_tasks, max_workers)` distinct processes have arrived (proves the runner's parallelism without
            relying on timing).

    Returns:
        `{"kind", "tasks": [{"index", "host", "pid"}, ...] in index order, "pids": distinct task process ids
        (sorted), "flow_pid": this flow's process id, "seconds": wall time of the tasks}`.
    """
    started = time.perf_counter()
    with make_task_runner(kind, max_workers, address=address) as runner:
        meet = {"rendezvous_dir": rendezvous_dir, "peers": min(n_tasks, max_workers)} if rendezvous_dir else {}
        futures = [
            runner.submit(where_task, parameters={"index": i, "seconds": seconds, **meet}) for i in range(n_tasks)
        ]
        results = [future.result() for future in futures]
    return {
        "kind": kind,
        "tasks": results,
        "pids": sorted({r["pid"] for r in results}),
        "flow_pid": os.getpid(),
        "seconds": round(time.perf_counter() - started, 3),
    }


def main(argv: list[str] | None = None) -> None:
    """`python -m flows.runners`: run the smoke flow on one runner and print its report as JSON."""
    parser = argparse.ArgumentParser(description="Check a task runner (and a cluster) with a tiny flow.")
    parser.add_argument("--kind", choices=TASK_RUNNERS, default="thread")
    parser.add_argument("--max-workers", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=0.2)
    parser.add_argument("--address", default=None, help="an existing Dask scheduler or Ray head")
    args = parser.parse_args(argv)
    report = runner_smoke_flow(
        kind=args.kind, max_workers=args.max_workers, n_tasks=args.tasks, seconds=args.seconds, address=args.address
    )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
