"""A cluster of several Ray nodes, and one that dies (`goodserve faults --scenario
node|controller-node|router-node`): Ray's own multi-node test cluster on this machine,
a head for Serve, the routers and the controller (or CPU nodes of their own), a node
per engine declaring its GPU kind and a spare node per kind. Each run is a process of
its own: a test process joins one Ray only."""

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


def test_losing_the_controllers_node_or_a_routers_node_loses_no_request(tmp_path):
    """The CPU nodes die in turn, with an ingress replica on each: the one running the
    controller and a router replica, then one running a router replica and no
    controller. The surviving router replica (its engines' output read by polling, so
    no engine waits on the dead callers) and ingress carry every request, and the
    controller and Serve start again off the lost node."""
    run = subprocess.run(
        [str(BIN / "goodserve"), "faults", "--scenario", "controller-node", "--scenario",
         "router-node", "--ingress-replicas", "2", "--requests", "30", "--rate", "5",
         "--out", str(tmp_path)],
        cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "faults.json").read_text())
    controller_node, router_node = report["scenarios"]
    assert "the controller" in controller_node["killed"]
    assert "the controller" not in router_node["killed"]
    for lost in (controller_node, router_node):
        assert lost["sent"] == lost["completed"] == 30, lost
        assert lost["lost"] == 0 and not lost["failed"] and not lost["rejected"], lost
        assert lost["greedy_kept"] == lost["greedy_checked"] > 0
        assert lost["retried_kept"] == lost["retried"]
        assert lost["replaced"] is True
