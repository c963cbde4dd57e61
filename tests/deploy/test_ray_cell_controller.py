"""deploy/ray_serve.py's CellController without a cluster: a router that reports a scripted load
and records what it is told, Serve's delete and the cell start recorded instead of run. The cell
count follows ceil(in flight / target) within min..max, only after the up/down delays; scale-in
drains the least busy cell (the newest among equals) and deletes it once its streams have ended;
a cell the router found unhealthy is removed at once; without autoscaling the count stays."""

from __future__ import annotations

import pytest

from tests.deploy.ray_support import load_ray_serve_module


class Reply:
    def __init__(self, value) -> None:
        self.value = value

    def result(self, timeout_s=None):
        return self.value


class Method:
    def __init__(self, call) -> None:
        self.call = call

    def remote(self, *args):
        return Reply(self.call(*args))


class ScriptedRouter:
    """The router's controller side (load, drain_cell, remove_cell, add_cell) over a dict."""

    def __init__(self, cells: dict) -> None:
        self.cells = cells
        self.load = Method(lambda: {a: dict(c) for a, c in self.cells.items()})
        self.drain_cell = Method(self._drain)
        self.remove_cell = Method(lambda app: self.cells.pop(app))
        self.add_cell = Method(self._add)

    def _drain(self, app):
        self.cells[app]["draining"] = True
        return self.cells[app]["in_flight"]

    def _add(self, app):
        self.cells[app] = cell(int(app.removeprefix("dspark-cell")), 0)


def cell(index: int, in_flight: int, healthy: bool = True, draining: bool = False) -> dict:
    return {"in_flight": in_flight, "healthy": healthy, "draining": draining,
            "unhealthy_s": None if healthy else 5.0, "node_id": f"node{index}", "cell": index}


@pytest.fixture
def controlled(monkeypatch):
    rs = load_ray_serve_module()
    now = [0.0]
    deleted, started = [], []
    monkeypatch.setattr(rs.serve, "delete", lambda name, _blocking=True: deleted.append(name))

    def start(self, count, taken):
        names = [rs.cell_app_name(self.next_index + i) for i in range(count)]
        self.next_index += count
        started.append((count, sorted(taken)))
        for name in names:
            self.router.add_cell.remote(name).result()
        return names

    monkeypatch.setattr(rs.CellController, "add_cells", start)

    def make(routed: dict, **config):
        config = rs.RayServeConfig(**{"cells": 1, "verifier_gpus": 0, "drafter_gpus": 0,
                                      **config})
        router = ScriptedRouter(routed)
        return rs.CellController(config, router, clock=lambda: now[0]), router

    return rs, now, deleted, started, make


def test_the_cell_count_follows_the_load_after_the_delays(controlled):
    rs, now, deleted, started, make = controlled
    controller, router = make({"dspark-cell0": cell(0, 0)}, min_cells=1, max_cells=3,
                              target_ongoing_requests=4, upscale_delay_s=2,
                              downscale_delay_s=5)
    assert controller.desired(router.cells) == 1
    router.cells["dspark-cell0"]["in_flight"] = 9  # ceil(9 / 4) = 3
    assert controller.desired(router.cells) == 3
    assert controller.step()["added"] == []  # not yet above target for upscale_delay_s
    now[0] = 2.0
    did = controller.step()
    assert did["added"] == ["dspark-cell1", "dspark-cell2"] and did["cells"] == 3
    assert started == [(2, ["node0"])]
    router.cells["dspark-cell0"]["in_flight"] = 40  # max_cells holds
    assert controller.desired(router.cells) == 3
    now[0] = 10.0
    assert controller.step()["added"] == []

    # Load falls to 5 in flight: 2 cells wanted, after downscale_delay_s the least busy drains.
    router.cells["dspark-cell0"]["in_flight"] = 3
    router.cells["dspark-cell1"]["in_flight"] = 1
    router.cells["dspark-cell2"]["in_flight"] = 1
    assert controller.step()["draining"] == []
    now[0] = 15.0
    did = controller.step()
    assert did["draining"] == ["dspark-cell2"]  # cells 1 and 2 equally busy: the newest goes
    assert did["draining_in_flight"] == [1]
    assert router.cells["dspark-cell2"]["draining"] and deleted == []
    now[0] = 16.0
    assert controller.step()["removed"] == []  # its stream runs on
    router.cells["dspark-cell2"]["in_flight"] = 0
    did = controller.step()
    assert did["removed"] == ["dspark-cell2"] and deleted == ["dspark-cell2"]
    assert set(router.cells) == {"dspark-cell0", "dspark-cell1"}

    # 4 in flight since t=16 (one cell wanted): at t=21 the least busy of the two drains.
    now[0] = 20.0
    assert controller.step()["draining"] == []
    now[0] = 21.0
    assert controller.step()["draining"] == ["dspark-cell1"]
    router.cells["dspark-cell1"]["in_flight"] = 0
    assert controller.step()["removed"] == ["dspark-cell1"]
    # No load: min_cells stay.
    router.cells["dspark-cell0"]["in_flight"] = 0
    now[0] = 60.0
    assert controller.step() == {"added": [], "draining": [], "draining_in_flight": [],
                                 "removed": [], "lost": [], "cells": 1, "wanted": 1}


def test_a_lost_cell_is_removed_and_replaced_without_autoscaling(controlled):
    rs, now, deleted, started, make = controlled
    controller, router = make({"dspark-cell0": cell(0, 3), "dspark-cell1": cell(1, 2, False)},
                              cells=2)
    did = controller.step()
    assert did["lost"] == ["dspark-cell1"] and deleted == ["dspark-cell1"]
    assert did["added"] == ["dspark-cell2"] and started == [(1, ["node0"])]
    assert controller.desired(router.cells) == 2  # whatever the load
    now[0] = 100.0
    assert controller.step()["added"] == []


def test_a_cell_whose_node_dies_before_it_runs_fails_its_start(monkeypatch):
    """run_apps with the nodes its cells are pinned to: while a cell deploys (Serve's status
    scripted), its node dying makes it raise at the next poll, naming the node, instead of
    waiting out the deadline for replicas that can never start; a live node lets it wait."""
    import types

    import ray

    rs = load_ray_serve_module()
    polls = []
    alive = {"node-a": True, "node-b": True}

    def status():
        polls.append(1)
        if len(polls) == 2:
            alive["node-b"] = False  # dies while the cell deploys
        return types.SimpleNamespace(applications={
            "dspark-cell3": types.SimpleNamespace(status="DEPLOYING", message="")})

    monkeypatch.setattr(rs.serve, "run_many", lambda targets, **kw: None)
    monkeypatch.setattr(rs.serve, "status", status)
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": n, "Alive": a} for n, a in alive.items()])
    monkeypatch.setattr("time.sleep", lambda s: None)
    with pytest.raises(RuntimeError, match="node node-b died before dspark-cell3 started"):
        rs.run_apps([("dspark-cell3", object())], node_ids=["node-b"])
    assert len(polls) == 2

    polls.clear()
    alive["node-b"] = True
    with pytest.raises(TimeoutError, match="dspark-cell3 DEPLOYING"):
        rs.run_apps([("dspark-cell3", object())], timeout_s=0.0, node_ids=["node-a"])
