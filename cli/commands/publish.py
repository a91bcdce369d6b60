"""`emrl publish TABLE ORG/NAME X.Y.Z`: publish a table folder as an immutable vX.Y.Z version (Hub or a folder)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cli.commands.parsing import add_settings
from cli.preflight import check_publish
from cli.settings import PUBLISH


def add(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    """Declare `emrl publish`."""
    p = sub.add_parser(
        "publish",
        parents=common,
        help="publish a table folder as an immutable vX.Y.Z version",
        description="Publish a table folder to the Hugging Face Hub (token: $HF_TOKEN or `hf auth "
        "login`) or to a local folder, tagged vX.Y.Z; an existing tag is never moved.",
    )
    p.add_argument("table_dir", type=Path, help="the table folder, e.g. OUT/sft")
    p.add_argument("repo_id", help="Hub dataset repo, e.g. my-org/emrl-sft")
    p.add_argument("version", help="X.Y.Z (tagged vX.Y.Z; an existing tag is never moved)")
    add_settings(p, PUBLISH)
    p.set_defaults(func=run, check=check_publish, prefect=True)


def run(args: argparse.Namespace) -> dict:
    """Run the publish flow; with --dry-run, list the plan."""
    from flows.publish import publish_dataset_flow  # lazy: Prefect and the flow add 1.1 s to `emrl --help` (measured)

    result = publish_dataset_flow(
        table_dir=str(args.table_dir),
        repo_id=args.repo_id,
        version=args.version,
        target="local" if args.local_root else "hub",
        local_root=None if args.local_root is None else str(args.local_root),
        private=not args.public,
        dry_run=args.dry_run,
        commercial=args.commercial,
        config_per_source=args.config_per_source,
    )
    for entry in result["plan"] if args.dry_run else []:
        print(f"{entry['action']:>9}  {entry['bytes']:>12}  {entry['path']}")
    print(result["message"])
    return result
