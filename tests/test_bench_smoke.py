"""The benchmark still runs end to end (its timings are not checked here)."""

import json
import subprocess
import sys


def test_bench_json_runs_and_reports_every_size():
    out = subprocess.run([sys.executable, "-m", "jbps.bench", "--sizes", "4K,64K", "--iters", "2",
                          "--skip-peers", "--json", "--credits", "2"], capture_output=True, text=True, timeout=300,
                         cwd="/")  # the installed package, not the source tree
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert [row["bytes"] for row in doc["rows"]] == [4096, 65536]
    assert all(row["jbps_median_s"] > 0 for row in doc["rows"])
    # Each worker pushes the buffer once per call (1 device, no padding).
    assert [row["bytes_pushed_per_call"] for row in doc["rows"]] == [4096, 65536]
    # The priority case ran and read its timings from the engine's trace.
    prio = doc["priority"]["results"]["2"]
    for order in ("forward", "backprop"):
        assert 0 < prio[order]["first_leaf_s"] <= prio[order]["total_s"]
