"""`jbps bench network` and `jbps bench overlap` across emulated hosts, run
small: every column they print comes from a real run whose results were
checked in the workers; bad input is one line and leaves nothing behind.
Needs root and iproute2, as tests/test_multihost.py."""

import json
import subprocess
import sys

import pytest

from conftest import REPO, job_free_env, needs_emulated_hosts
from test_launch import run

from jbps.runtime import FFI_TARGET

pytestmark = needs_emulated_hosts


def _run(module, *argv, timeout=600, env=None):
    """The bench's run (returncode, stdout, stderr), checked to have removed
    every namespace it made: those named after its PID (the emulated cluster's
    run id), so that another test's cluster, running at the same time, is not counted."""
    proc, out, err = run([sys.executable, "-m", module, *argv], env or job_free_env(), timeout=timeout, cwd=REPO)
    assert _namespaces_of(proc.pid) == set(), err[-3000:]
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _namespaces_of(pid):
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith(f"jbps-{pid}-")}


def _run_json(module, *argv, env=None):
    """The bench's --json document."""
    proc = _run(module, *argv, "--json", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_network_bench_runs_every_tool_and_reports_the_split(tmp_path):
    # The jobs run in the caller's environment (here XLA_FLAGS: their programs are dumped)
    # without its job variables (a stray setting would fail every psum).
    dump = tmp_path / "xla"
    env = job_free_env(XLA_FLAGS=f"--xla_dump_to={dump}", JBPS_PARTITION_BYTES="not a size")
    doc = _run_json(
        "benchmarks.network",
        "--workers",
        "2",
        "--cpu-hosts",
        "0,1",
        "--size",
        "1M",
        "--rate",
        "1G",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--compression",
        "bf16",
        env=env,
    )
    programs = [f.read_text(errors="replace") for f in dump.glob("*.txt")]
    assert any(f'custom_call_target="{FFI_TARGET}"' in p for p in programs), len(programs)
    cases = {c["k"]: c["jbps"] for c in doc["cases"]}
    for k in (0, 1):
        assert cases[k]["defaults"]["median_s"] > 0 and cases[k]["compression bf16"]["median_s"] > 0, cases[k]
    assert doc["peers"]["gloo"]["median_s"] > 0 and doc["peers"]["mpi"]["median_s"] > 0
    assert doc["link_check"]["share_of_cap_min"] > 0
    # The machine's CPU time, metered by one process of each tool around each timed call.
    metered = [cases[k]["defaults"]["cpu"] for k in (0, 1)] + [doc["peers"][p]["cpu"] for p in ("gloo", "mpi")]
    for cpu in metered:
        assert cpu["calls"] == 2 and 0 <= cpu["busy_share"] <= 1 and cpu["busy_core_s"] >= 0, cpu
    # With one CPU host and 2 workers the CPU host's server gets half of each worker's
    # psum bytes (x = 1/2; init's link probes, which every server gets alike, left out).
    pushed = cases[1]["defaults"]["psum_mib_pushed"]
    assert abs(pushed["2"] - (pushed["0"] + pushed["1"])) <= 0.25 * pushed["2"], pushed
    received = cases[1]["defaults"]["server_mib_received"]
    assert received["2"] > pushed["2"] and received["0"] > pushed["0"], (received, pushed)
    # The compressed variant against float32 in its goals, with the machine's CPU floor.
    goals = {g["what"]: g for g in doc["goals"]}
    for k in (0, 1):
        g, bf16 = goals[f"jbps bf16 / float32, k = {k}"], cases[k]["compression bf16"]
        assert g["ratio"] == pytest.approx(bf16["median_s"] / cases[k]["defaults"]["median_s"])
        assert g["cpu_floor"] == pytest.approx(
            bf16["cpu"]["busy_core_s"] / bf16["cpu"]["cores"] / cases[k]["defaults"]["median_s"]
        )


def test_overlap_bench_times_every_case():
    doc = _run_json(
        "benchmarks.overlap",
        "--cpu-hosts",
        "0",
        "--layers",
        "3",
        "--width",
        "256",
        "--batch",
        "64",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--bucket-bytes",
        "64K",
        "--scan",
        "2",
    )
    case = doc["cases"]["0"]
    for name in ("comm", "one call", "buckets", "buckets 64 KiB", "scan 2"):
        assert case[name]["median_s"] > 0, name
    assert case["scan_over_bound"] == pytest.approx(
        case["scan 2"]["median_s"] / max(doc["compute"]["median_s"], case["comm"]["median_s"])
    )
    assert doc["one_process"]["median_s"] > 0 and doc["compute"]["median_s"] > 0 and doc["gloo"]["median_s"] > 0
    assert doc["describe"] == "an MLP of 3 x 256² float32" and doc["grad_bytes"] == 3 * (256 * 256 + 256) * 4
    for result in (doc["one_process"], doc["gloo"], case["buckets"]):
        workers = len(result["per_worker_s"])
        assert result["samples_per_s"] == pytest.approx(workers * 64 / result["median_s"]), result
    # The trace of a bucketed step: one row per bucket's call (3 kernels and their biases).
    rows = case["buckets"]["trace"][1:]
    assert rows and all(r["pushes"] and r["pulls"] for r in rows), rows
    # The machine's CPU time: its kinds add up to at most what was busy (steps this
    # short may fall within one clock tick: 0), and the bound is the step's and the
    # psum's CPU time over the cores.
    for cpu in (doc["compute"]["cpu"], case["comm"]["cpu"], case["buckets"]["cpu"]):
        kinds = cpu["user_core_s"] + cpu["system_core_s"] + cpu["interrupt_core_s"]
        assert 0 <= kinds <= cpu["busy_core_s"] + 1e-9 and 0 <= cpu["busy_share"] <= 1, cpu
    per_step = doc["compute"]["cpu_core_s_per_step"] + case["comm"]["cpu_core_s_per_step"]
    assert case["cpu_bound_s"] == pytest.approx(per_step / doc["compute"]["cpu"]["cores"])


def test_a_rate_changed_mid_run_reaches_the_links_and_the_table():
    # Worker 0 pauses before timed call 2 until the bench has changed the CPU host's link
    # (a lost handshake fails the job after its timeout); every call is reported.
    argv = ["--workers", "2", "--cpu-hosts", "1", "--size", "2M", "--rate", "400M", "--iters", "4", "--warmup", "1"]
    proc = _run("benchmarks.network", *argv, "--change", "s0=100M@2", "--skip-peers", "-v")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "host 2's link set to 100 Mbit/s before timed call 2" in proc.stderr, proc.stderr[-3000:]
    assert "Host 2's link changed to 100 Mbit/s before timed call 2" in proc.stdout, proc.stdout
    follow = [line for line in proc.stdout.splitlines() if "calls after the rate change" in line]
    assert len(follow) == 1 and "k = 1" in follow[0], proc.stdout
    doc = _run_json("benchmarks.network", *argv, "--change", "w1=100M@3", "--skip-peers")
    assert doc["rate_change"] == {"host": 1, "rate_bits_per_s": 1e8, "at_call": 3}
    (case,) = doc["cases"]
    assert len(case["jbps"]["defaults"]["per_call_s"]) == 4
    # A worker's link at a quarter of the others' takes the optimum well above the formula's.
    assert case["optimum_after_change_s"] > 2 * case["formula_s"], case


def test_the_spare_host_bench_runs_each_case_side_by_side():
    doc = _run_json("benchmarks.spare_host", "--blocks", "1", "--block-steps", "5", "--runs", "1")
    assert set(doc["seconds"]) == {"with", "without", "fixed"}
    for case, runs in doc["seconds"].items():
        assert len(runs) == 1 and runs[0] > 0, (case, runs)
        assert doc["over_without"][case] == pytest.approx(runs[0] / doc["seconds"]["without"][0])
    assert doc["rate_bits_per_s"] == 300e6 and doc["spare_rate_bits_per_s"] == 30e6


def test_the_tcp_floor_bench_moves_the_bytes_both_ways_no_faster_than_the_cap():
    doc = _run_json("benchmarks.tcp_floor", "--iters", "2", "--size", "4M", "--host-rate", "200M")
    assert len(doc["per_call_s"]) == 2 and doc["raw_rate_s"] == pytest.approx(4 * 2**20 * 8 / 200e6)
    # The cap holds (less the burst it lets through at once, 160 KiB), and the calls end.
    assert all(0.9 * doc["raw_rate_s"] <= s < 10 * doc["raw_rate_s"] for s in doc["per_call_s"]), doc


@pytest.mark.parametrize(
    "module,argv,needle",
    [
        ("benchmarks.network", ["--rate", "fast"], "fast"),
        ("benchmarks.network", ["--size", "12 apples"], "12 apples"),
        ("benchmarks.network", ["--workers", "200", "--cpu-hosts", "60"], "254"),
        ("benchmarks.network", ["--compression", "int8"], "int8"),
        ("benchmarks.network", ["--change", "w0=400M"], "w0=400M"),
        ("benchmarks.network", ["--change", "w7=1M@2"], "w7=1M"),
        ("benchmarks.network", ["--iters", "4", "--change", "w0=1M@4"], "w0=1M@4"),
        ("benchmarks.overlap", ["--rate", "fast"], "fast"),
        ("benchmarks.overlap", ["--bucket-bytes", "lots"], "lots"),
        ("benchmarks.spare_host", ["--spare-rate", "fast"], "fast"),
        ("benchmarks.tcp_floor", ["--host-rate", "fast"], "fast"),
        ("benchmarks.tcp_floor", ["--peers", "0"], "--peers"),
        ("benchmarks.elastic_join", ["--workers", "1"], "--workers"),
        ("benchmarks.elastic_join", ["--model", "resnet", "--placed-state"], "--placed-state"),
    ],
)
def test_bad_input_is_one_line_naming_it(module, argv, needle):
    proc = _run(module, *argv, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert needle in last and "Traceback" not in proc.stderr, proc.stderr[-2000:]
