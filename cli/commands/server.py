"""`emrl server up|down|status`: a local Prefect server, worker and the deployments (`make serve`; `cli.server`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from cli.commands.parsing import CREDENTIALS, Formatter, Parser, add_settings
from cli.settings import SERVER_STATUS, SERVER_UP, SERVER_WHERE


def add(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    """Declare `emrl server` and its actions."""
    p = sub.add_parser(
        "server",
        parents=common,
        help="local Prefect server + worker + deployments (make serve)",
        description="A local Prefect server (UI included), the emrl-local process pool, the "
        "deployments of prefect.yaml and a worker; state in .prefect-home/server/.",
    )
    p.set_defaults(func=run)
    actions = p.add_subparsers(dest="server_action", required=True, metavar="ACTION", parser_class=Parser)
    where = argparse.ArgumentParser(add_help=False, parents=common)
    add_settings(where, SERVER_WHERE)
    up = actions.add_parser("up", parents=[where], help="start server, pool, deployments and worker")
    add_settings(up, SERVER_UP)
    actions.add_parser("down", parents=[where], help="stop what `up` started; mark its active runs Cancelled")
    status = actions.add_parser("status", parents=[where], help="is it running; is PREFECT_API_URL set right")
    add_settings(status, SERVER_STATUS)
    for action in actions.choices.values():
        action.formatter_class, action.epilog = Formatter, CREDENTIALS


def up_message(state: Any) -> str:
    """What `emrl server up` prints: addresses, the run commands in pipeline order, how to stop."""
    from cli.server import ENV_NAME  # lazy: httpx and yaml add 0.05 s to `emrl --help` (measured)

    home = Path(state.prefect_home)
    worker = ", ".join(f"{n} pid {r.pid} (log {r.log})" for n, r in state.processes.items())
    lines = [
        f"Prefect server running (PREFECT_HOME={home})",
        f"  UI:   {state.ui_url}",
        f"  API:  {state.api_url}",
        f"  pool: {state.pool}; {worker or 'no worker'}",
        "",
        f"In each shell: source {home / ENV_NAME}   (the API URL, and the venv's prefect and emrl on PATH)",
        "Then run the pipeline in this order (FLOW/DEPLOYMENT; --watch follows the run's logs):",
        *(f"  prefect deployment run {name} --watch" for name in state.deployments),
        "",
        "Stop everything: make serve-stop   (or: emrl server down)",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run `emrl server up|down|status`; return the exit status (0 ok, 1 problems)."""
    from cli import server  # lazy: httpx and yaml (see up_message)

    if args.server_action == "up":
        try:
            state = server.server_up(
                project_root=args.project_root,
                home=args.home,
                port=args.port,
                deploy=args.deploy,
                worker=args.worker,
                timeout_s=args.timeout_s,
            )
        except server.ServerError as exc:
            print(f"emrl server up failed: {exc}", file=sys.stderr)
            return 1
        print(up_message(state))
        return 0
    if args.server_action == "down":
        stopped = server.server_down(project_root=args.project_root, home=args.home)
        print("Stopped: " + ", ".join(stopped) if stopped else "Nothing was running.")
        return 0
    report = server.server_status(project_root=args.project_root, home=args.home)
    if args.json:
        print(json.dumps(report, indent=2))
    elif report["running"]:
        print(
            f"running: UI {report['ui_url']}, API {report['api_url']}, pool {report['pool']} "
            f"({report['pool_status']}), deployments: {', '.join(report['deployments']) or 'none'}"
        )
    for problem in report["problems"]:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    return 0 if report["ok"] else 1
