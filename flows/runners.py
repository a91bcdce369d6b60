"""Task-runner choice per flow run: `thread`, `process`, `dask` or `ray` (issue 5, scale-out).

The flows take a `task_runner` parameter (a plain string, so it fits a deployment's parameter schema and `-p
task_runner='"process"'`) and build the runner with `make_task_runner` inside the flow body::

    with make_task_runner(task_runner, max_workers) as runner:
        futures = [runner.submit(curate_batch_task, parameters={...}) for batch in batches]

- `thread` (default): `ThreadPoolTaskRunner`; right for I/O (NIfTI reads, Hub uploads) and for the GIL-releasing
  parts of curation (isal inflate, cc3d, OpenCV).
- `process`: `ProcessPoolTaskRunner` (Prefect core, spawn start method); true CPU parallelism on one machine. Task
  arguments and results must pickle, and every worker process talks to the Prefect API, so run it against a real
  server (`PREFECT_API_URL`) or the test harness, never in ephemeral mode (each child would start its own temporary
  server: `notes/prefect_hub.md` §2.3).
- `dask`: `prefect_dask.DaskTaskRunner` (extra `pip install -e ".[dask]"`): a local cluster of `max_workers`
  single-threaded worker processes, or an existing scheduler with `address="tcp://host:8786"`.
- `ray`: `prefect_ray.RayTaskRunner` (extra `pip install -e ".[ray]"`): a local Ray with `max_workers` CPUs, or an
  existing cluster with `address="ray://head:10001"`.

Runners that leave the flow's process (`process`, `dask`, `ray`) need the case store and any persisted task results
on storage every worker can reach: see `docs/scaling.md`.

`python -m flows.runners --kind dask --address tcp://sched:8786` runs a tiny smoke flow on a runner and prints which
hosts and processes ran its tasks: check a cluster with it before sending it the atlas.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import socket
import time
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ProcessPoolTaskRunner, TaskRunner, ThreadPoolTaskRunner


logger = logging.getLogger(__name__)

TASK_RUNNERS = ("thread", "process", "dask", "ray")
# kind -> (module, class, extra that installs it)
_EXTERNAL_RUNNERS = {
    "dask": ("prefect_dask", "DaskTaskRunner", "dask"),
    "ray": ("prefect_ray", "RayTaskRunner", "ray"),
}


class TaskRunnerUnavailableError(ImportError):
    """The chosen task runner's integration package is not installed."""


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
        return ThreadPoolTaskRunner(max_workers=max_workers)
    if kind == "process":
        return ProcessPoolTaskRunner(max_workers=max_workers)
    runner_class = _runner_class(kind)
    if kind == "dask":
        if address is not None:
            return runner_class(address=address)
        return runner_class(cluster_kwargs={"n_workers": max_workers, "threads_per_worker": 1, "processes": True})
    if address is not None:
        return runner_class(address=address)
    return runner_class(init_kwargs={"num_cpus": max_workers, "include_dashboard": False})


def runner_available(kind: str) -> bool:
    """Return whether `make_task_runner(kind, ...)` can build this runner here (its extra is installed)."""
    if kind not in TASK_RUNNERS:
        raise ValueError(f"task_runner={kind!r} is not one of {TASK_RUNNERS}.")
    if kind not in _EXTERNAL_RUNNERS:
        return True
    try:
        _runner_class(kind)
    except TaskRunnerUnavailableError:
        return False
    return True


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


@task(cache_policy=NO_CACHE)
def where_task(index: int, seconds: float) -> dict[str, Any]:
    """Sleep `seconds`, then return where this task ran (host, process id) and its index."""
    time.sleep(seconds)
    return {"index": index, "host": socket.gethostname(), "pid": os.getpid()}


@flow(name="task-runner-smoke")
def runner_smoke_flow(
    kind: str = "thread", max_workers: int = 2, n_tasks: int = 4, seconds: float = 0.2, address: str | None = None
) -> dict[str, Any]:
    """Run `n_tasks` tiny tasks on the chosen runner and report which hosts and processes ran them.

    Args:
        kind: the task runner, see `make_task_runner`.
        max_workers: the runner's size, see `make_task_runner`.
        n_tasks: tasks to submit.
        seconds: how long each task sleeps.
        address: an existing Dask/Ray cluster, see `make_task_runner`.

    Returns:
        `{"kind", "tasks": [{"index", "host", "pid"}, ...] in index order, "pids": distinct task process ids
        (sorted), "flow_pid": this flow's process id, "seconds": wall time of the tasks}`.
    """
    started = time.perf_counter()
    with make_task_runner(kind, max_workers, address=address) as runner:
        futures = [runner.submit(where_task, parameters={"index": i, "seconds": seconds}) for i in range(n_tasks)]
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
