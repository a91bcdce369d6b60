"""Every deployment in prefect.yaml points at a loadable flow whose name is the deployment's flow name."""

from __future__ import annotations

from pathlib import Path

import yaml
from prefect.flows import load_flow_from_entrypoint


ROOT = Path(__file__).resolve().parents[2]


def test_prefect_yaml_entrypoints_load_and_names_match() -> None:
    config = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    names = []
    for deployment in config["deployments"]:
        flow = load_flow_from_entrypoint(str(ROOT / deployment["entrypoint"]), use_placeholder_flow=False)
        assert flow.name == deployment["name"], deployment["entrypoint"]
        assert all(not s.get("active", True) for s in deployment.get("schedules", [])), "schedules ship inactive"
        assert set(deployment.get("parameters", {})) <= set(flow.parameters.properties), deployment["name"]
        names.append(flow.name)
    assert "build-sft-set" in names
