"""A cluster of several Ray nodes, and one that dies (`goodserve faults --scenario
node`): Ray's own multi-node test cluster on this machine, a head for Serve, the
routers and the controller, a node per engine declaring its GPU kind and a spare node
per kind. Each run is a process of its own: a test process joins one Ray only."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.integration.test_app_lifetime import BIN, ROOT, environment

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("config", [None, "configs/local-sim-pd.yaml"],
                         ids=["unified", "prefill-decode"])
def test_a_node_lost_mid_replay_loses_no_request_and_its_engines_come_back(config, tmp_path):
    """Engines land on nodes of their GPU kind (in P/D mode the pools span nodes); when
    the node of the busiest engine dies, its requests move or run again by token ids
    and every one completes with the greedy text kept, the routers stop routing to its
    engines within seconds, and the controller starts them again on the spare node."""
    args = [str(BIN / "goodserve"), "faults", "--scenario", "node", "--requests", "30",
            "--rate", "5", "--out", str(tmp_path)]
    if config is not None:
        args += ["--config", config]
    run = subprocess.run(args, cwd=ROOT, env=environment(), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "faults.json").read_text())
    (node,) = report["scenarios"]
    assert node["killed"].startswith("the node of ")
    assert node["engines_on_their_kind"] is True
    assert node["sent"] == node["completed"] == 30, node
    assert node["lost"] == 0 and not node["failed"] and not node["rejected"], node
    assert node["moved"] >= 1 and node["moved_kept"] == node["moved"]
    assert node["greedy_kept"] == node["greedy_checked"] > 0
    assert node["dropped_after_s"] is not None and node["dropped_after_s"] < 10.0
    assert node["replaced"] is True
