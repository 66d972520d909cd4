"""`jbps bench`'s latency sweep runs end to end and its breakdown adds up (timings are not
checked: the workers check every sum they time, in place and out of place)."""

import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import REPO
from benchmarks import latency, peers
from benchmarks.__main__ import format_table
from benchmarks.stages import STAGES, call_stages, typical_stages

SWEEP = [4096, 16384]


@pytest.fixture(scope="module")
def doc():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "--sizes",
            "64K",
            "--iters",
            "3",
            "--skip-peers",
            "--skip-priority",
            "--skip-small-tensors",
            "--skip-memory",
            "--json",
            "--latency-sizes",
            "4K,16K",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )  # the lab runs from the checkout
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_sweep_times_in_place_and_out_of_place(doc):
    rows = {r["bytes"]: r for r in doc["latency"]["rows"]}
    assert sorted(rows) == SWEEP + [65536]  # the sweep's sizes, then the size rows'
    for r in rows.values():
        assert r["jbps_in_place_s"] > 0 and r["jbps_out_of_place_s"] > 0
        assert r["out_of_place_over_in_place"] == pytest.approx(r["jbps_out_of_place_s"] / r["jbps_in_place_s"])
        assert r["mpi_in_place_s"] is None and r["in_place_over_mpi"] is None  # --skip-peers
    jbps = doc["tools"]["jbps"]["results"]["65536"]  # the size rows ran out of place too
    assert jbps["out_of_place"]["iters"] == 3 and jbps["out_of_place"]["median_s"] > 0


def test_stages_add_up_to_the_call(doc):
    stages = doc["latency"]["stages"]
    assert [s["bytes"] for s in stages] == SWEEP
    for s in stages:
        assert s["calls"] >= 1 and s["total"] > 0
        assert sum(s[key] for key, _ in STAGES) == pytest.approx(s["total"])
        # Each stamp follows the one before it on this worker's own clock.
        for key in ("dispatch", "push", "pull", "tree", "complete", "return"):
            assert s[key] >= 0, (key, s)


def test_targets_and_table(doc):
    targets = {t["what"]: t for t in doc["latency"]["targets"]}
    assert targets["4 KiB psum, in place"]["value"] > 0 and targets["4 KiB psum, in place"]["target"] == 100e-6
    assert targets["64 MiB jbps/MPI, out of place"]["value"] is None  # no 64 MiB row, no MPI
    table = format_table(
        {
            **doc,
            "tools": {
                k: t and {**t, "results": {int(s): r for s, r in t["results"].items()}} for k, t in doc["tools"].items()
            },
        }
    )
    assert "latency: jbps psum" in table and "where a jbps psum's time goes" in table
    assert "PASS" not in table.split("latency: jbps psum")[1].split("ratios: jbps against the reference named")[0]


def test_call_stages_from_stamps():
    record = {
        "failed": False,
        "submitted": 110,
        "pushed": 130,
        "sum_arrived": 300,
        "pulled": 310,
        "tree_checked": 0,
        "done": 330,
        "server_ns": 40,
        "peer_wait_ns": 50,
    }
    s = call_stages(record, 100, 400)
    assert s["dispatch"] == pytest.approx(10e-9) and s["push"] == pytest.approx(20e-9)
    assert s["wire"] == pytest.approx((170 - 40 - 50) * 1e-9) and s["tree"] == 0
    assert s["complete"] == pytest.approx(20e-9) and s["return"] == pytest.approx(70e-9)
    assert sum(s[k] for k, _ in STAGES) == pytest.approx(s["total"]) == pytest.approx(300e-9)
    assert call_stages({**record, "failed": True}, 100, 400) is None
    assert call_stages({**record, "pushed": 0}, 100, 400) is None


def test_typical_stages_is_the_middle_half():
    calls = [{"total": t, "push": t / 2} for t in (1.0, 2.0, 3.0, 4.0, 100.0, 0.5, 2.5, 3.5)]
    out = typical_stages(calls + [None])
    assert out["calls"] == 4 and out["total"] == pytest.approx((2.0 + 2.5 + 3.0 + 3.5) / 4)
    assert out["push"] == pytest.approx(out["total"] / 2) and out["median_total"] == pytest.approx(2.75)


def test_rows_compare_out_of_place_with_mpi_out_of_place():
    tools = {
        "jbps": {"results": {4096: {"median_s": 2.0, "out_of_place": {"median_s": 3.0}}}},
        "mpi": {"results": {4096: {"median_s": 1.0, "out_of_place": {"median_s": 1.5}}}},
        "gloo": {"results": {4096: {"median_s": 8.0}}},
    }
    [row] = latency.make_rows({"sizes": [4096], "tools": tools}, None)
    assert row["in_place_over_mpi"] == 2.0 and row["out_of_place_over_mpi"] == 2.0
    assert row["in_place_over_gloo"] == 0.25 and row["out_of_place_over_in_place"] == 1.5


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="mpi4py is not installed")
def test_mpi_peer_times_out_of_place():
    out = peers.run_mpi_allreduce([4096], 2, 1, timeout_s=120, out_of_place=True)
    r = out["results"][4096]
    assert r["median_s"] > 0 and r["out_of_place"]["median_s"] > 0 and r["out_of_place"]["iters"] == 2
