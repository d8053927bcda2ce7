"""bench/replica_sim.py: the replica simulation runs on a small case, conserves requests, and
affinity routing pages in no more adapters than round robin."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import replica_sim  # noqa: E402


def small_costs() -> dict:
    """The measured costs with a pool that holds about 20 adapters, so that routing matters."""
    costs = replica_sim.measured_costs()
    return {**costs, "pool_adapter_bytes": 20 * 30 * costs["bytes_per_rank"]}


def test_affinity_loads_no_more_than_round_robin():
    costs = small_costs()
    rows = {p: replica_sim.simulate(4, 200, p, 4.0, 20.0, costs) for p in ("round_robin", "affinity")}
    rr, aff = rows["round_robin"], rows["affinity"]
    for row in rows.values():
        assert row["requests"] == 320
        assert row["throughput_req_s"] * row["makespan_s"] == pytest.approx(row["requests"], rel=1e-9)
        assert row["h2d_bytes"] >= row["adapter_loads"] * 8 * costs["bytes_per_rank"]
    assert aff["adapter_loads"] <= rr["adapter_loads"]
    assert aff["adapter_loads"] < 0.8 * rr["adapter_loads"]  # each adapter has one home replica


def test_one_replica_routes_the_same_either_way():
    costs = small_costs()
    rr, aff = (replica_sim.simulate(1, 50, p, 4.0, 10.0, costs) for p in ("round_robin", "affinity"))
    assert rr["adapter_loads"] == aff["adapter_loads"] and rr["ttft_p99_s"] == aff["ttft_p99_s"]

