"""Re-planning the split while a job runs (jbps/replan.py, Engine::SetRoutes).

The engine part runs real jobs whose servers listen on another loopback
address (so the workers see a job that spans hosts, where the split can
move): new splits announced by each worker at steps of its own, while
bucketed multi-device steps are in flight, move every psum at the same round
on every worker, and every sum stays exact (numpy). The follower's decisions
are checked on readings given to it directly."""

import json
import math

import numpy as np
import pytest

from benchmarks.local_cluster import LocalCluster
from conftest import last_json, worker_script
from jbps import replan
from jbps.partition import COLOCATED, DEDICATED, server_fractions

ENV = {
    "JBPS_FOLLOW_RATES": "0",  # the splits come from the test, at its chosen steps
    "JBPS_PARTITION_BYTES": "16K",  # many chunks a call: shares near the split's
    "JBPS_BUCKET_BYTES": "256K",
    "JBPS_TIMEOUT_S": "30",
}


def _job(announce, splits, *, shm="1", workers=2, devices=2):
    env = dict(ENV, JBPS_SHM=shm)
    with LocalCluster(workers, 2, local_devices=devices, env=env, bind_host="127.0.0.2", timeout_s=150) as cluster:
        results = cluster.run_workers(
            [worker_script("replan_exact.py"), "--announce", announce, "--splits", json.dumps(splits)]
        )
    reports = []
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        reports.append(last_json(r.stdout))
    return reports


@pytest.mark.parametrize("shm", ["1", "0"])
def test_new_splits_move_every_psum_at_the_same_round_and_every_sum_stays_exact(shm):
    # Worker 0 announces the first split at step 3 and the second at 12,
    # worker 1 at 7 and 10: each split is used once both hold it.
    reports = _job("3,12;7,10", [[0.8, 0.2], [0.1, 0.9]], shm=shm)
    for report in reports:
        assert report["wrong"] == [], report
        assert report["routes_announced"] == 2 and report["routes_used"] == 2, report
        share = report["pushed"][0] / sum(report["pushed"])
        assert abs(share - 0.1) < 0.06, report  # within a chunk of each call's share
        # A psum routed to server 0 alone: with fixed routes (the follower's probe) it all goes
        # there whatever the split; without, the split in use deals it out again.
        (fixed, fixed_sum), (dealt, dealt_sum) = report["to_first"]["True"], report["to_first"]["False"]
        assert fixed_sum and dealt_sum, report
        assert fixed == [400_000, 0] and dealt[1] > 0.5 * sum(dealt), report


def test_a_split_not_every_worker_announced_is_never_used():
    reports = _job("4;", [[0.9, 0.1]])
    for report in reports:
        assert report["wrong"] == [], report
        assert report["routes_used"] == 0, report
        share = report["pushed"][0] / sum(report["pushed"])
        assert abs(share - report["init_split"][0]) < 0.06, report  # the split jbps.init chose


def test_a_split_is_refused_in_a_job_whose_routes_cannot_change(session):
    from jbps.extension import load_core

    with pytest.raises(ValueError, match=r"^jbps: a new split: this job's routes cannot change"):
        load_core().engine_set_routes([1.0])


# The follower's decisions, on agreed windows given directly.

ROLES = [COLOCATED] * 4 + [DEDICATED] * 2
FULL = 125e6  # 1 Gbit/s in bytes/s
BASE = [30e6, 25e6, 28e6, 33e6, 30e6, 31e6]  # per worker, as on 1 Gbit/s links at the formula's split


def _follower():
    from jbps.partition import server_fractions

    return replan.RateFollower(ROLES, 4, [FULL] * 6, server_fractions(ROLES, 4))


def _window(readings, settled=True, links=(), push_bytes=0.0):
    """A window of these readings and, if given, each worker machine's link as its worker read
    it and the workers' mean push size."""
    return replan.Window(tuple(readings), settled, (), tuple(links), push_bytes)


def test_equal_links_read_with_noise_never_move_the_split():
    rng = np.random.default_rng(0)
    follower = _follower()
    assert all(follower.step(_window([b * rng.uniform(0.85, 1.15) for b in BASE])) is None for _ in range(300))
    # With each worker machine's link read too (its worker's fastest reading), as noisy.
    follower = _follower()
    for _ in range(300):
        noisy = [b * rng.uniform(0.85, 1.15) for b in BASE]
        links = [40e6 * rng.uniform(0.85, 1.15) for _ in range(4)] + [0.0, 0.0]
        assert follower.step(_window(noisy, links=links)) is None


def test_a_server_that_slows_moves_the_split_after_a_few_windows_and_back_when_it_recovers():
    from jbps.link_rate import fractions_for_rates

    follower = _follower()
    slow = BASE[:5] + [BASE[5] * 0.6]  # a CPU machine's link at 0.6 of its rate
    assert follower.step(_window(BASE, settled=False)) is None  # not a baseline: the split was still moving
    for _ in range(replan.BASELINE_WINDOWS):
        assert follower.step(_window(BASE)) is None  # the baseline
    assert follower.baseline is not None
    for _ in range(replan.WINDOWS_TO_CHANGE - 1):
        assert follower.step(_window(slow)) is None  # fewer windows running are not a change
        # A window without a psum (a step longer than a window) is no news: the count goes on.
        assert follower.step(_window([0.0] * len(BASE))) is None
    split = follower.step(_window(slow))
    # Planned at the rate read, its share for a little less: a share too large would set every call's pace.
    assert follower.planned[5] == pytest.approx(0.6 * FULL)
    assert split == pytest.approx(fractions_for_rates(ROLES, [FULL] * 5 + [replan.SLOWED_SHADE * 0.6 * FULL], 4))
    assert split[5] < split[4]
    # The next settled windows are the new baseline; then the link recovers.
    for _ in range(replan.BASELINE_WINDOWS):
        assert follower.step(_window(slow)) is None
    fast = slow[:5] + [slow[5] / 0.6]
    for _ in range(replan.WINDOWS_TO_CHANGE - 1):
        assert follower.step(_window(fast)) is None
    back = follower.step(_window(fast))
    assert back is not None and back[5] == pytest.approx(back[4])


def test_a_change_counts_per_server_and_a_window_without_its_reading_does_not_break_it():
    def ready():
        follower = _follower()
        for _ in range(replan.BASELINE_WINDOWS):
            follower.step(_window(BASE))
        return follower

    def slow(s):
        return [b * 0.5 if i == s else b for i, b in enumerate(BASE)]

    # Slower readings of different servers in turn are no server's change.
    follower = ready()
    assert all(follower.step(_window(slow(s))) is None for s in (5, 4, 5, 4, 5))
    # Host 5 slow, then a window where only the others push (host 5 has no reading), then slow again.
    follower = ready()
    unread = BASE[:5] + [0.0]
    windows = [slow(5), unread] * (replan.WINDOWS_TO_CHANGE - 1)
    assert all(follower.step(_window(w)) is None for w in windows)
    split = follower.step(_window(slow(5)))
    assert split is not None and split[5] < split[4] and follower.planned[5] == pytest.approx(0.5 * FULL)


def test_a_slowdown_read_in_one_window_only_or_in_a_quieter_phase_everywhere_moves_nothing():
    follower = _follower()
    for _ in range(replan.BASELINE_WINDOWS):
        follower.step(_window(BASE))
    slow = BASE[:5] + [BASE[5] / 1.8]
    for readings in (slow, BASE, slow, BASE):
        assert follower.step(_window(readings)) is None
    quiet = [b / 3 for b in BASE]
    assert all(follower.step(_window(quiet)) is None for _ in range(5))


def test_windows_of_other_pushes_are_no_news_and_a_phase_of_them_takes_its_own_baseline():
    # A job of small psums reads its links at their latency, by phases: the loop family
    # across emulated hosts read the same links at 32-37 MB/s in a phase of 5.7 KB pushes
    # and at a tenth of that in phases of 240-720 B ones, and every served server was
    # re-planned at a tenth of its rate. Windows of pushes unlike the baseline's move nothing.
    follower = _follower()
    for _ in range(replan.BASELINE_WINDOWS):
        assert follower.step(_window(BASE, push_bytes=5700)) is None
    small = [b / 10 for b in BASE]
    for size in (300, 700, 240) * 2:
        assert follower.step(_window(small, push_bytes=size)) is None
    # Enough of them running make a phase, with a baseline of its own: a slowdown in it
    # (its pushes alike, 240-480 B) is read as one.
    assert follower.baseline is None
    for _ in range(replan.BASELINE_WINDOWS):
        assert follower.step(_window(small, push_bytes=300)) is None
    assert follower.baseline == pytest.approx(small)
    slow = small[:5] + [small[5] / 2]
    moved = [follower.step(_window(slow, push_bytes=size)) for size in (240, 480, 300)]
    assert moved[:2] == [None, None] and moved[2] is not None and moved[2][5] < moved[2][4]
    # A baseline is of one phase: windows of other pushes among its first start it again.
    follower = _follower()
    for size in (5700, 300, 5700, 5700):
        follower.step(_window(BASE if size > 1000 else small, push_bytes=size))
    assert follower.baseline is None
    follower.step(_window(BASE, push_bytes=5700))
    assert follower.baseline == pytest.approx(BASE)


def test_a_server_left_out_is_probed_now_and_then_and_comes_back_once_it_reads_faster():
    from jbps import link_rate

    # CPU host 5 at a tenth of the others' rate: the rated split leaves it out.
    slow = [FULL] * 5 + [FULL / 10]
    fractions = link_rate.fractions_for_rates(ROLES, slow, 4)
    assert fractions[5] == 0
    follower = replan.RateFollower(ROLES, 4, slow, fractions)
    readings = BASE[:5] + [0.0]  # no pushes reach it, so no reading
    # That server alone, sized for the job's full rate.
    size = link_rate.server_probe_bytes(DEDICATED, 4, FULL, replan.PROBE_S)
    assert size > 4 * (160 << 10)  # beyond a rate cap's burst (benchmarks/emulated_network.py)

    def window(rate=None):  # CPU host 4, serving at the full rate, is probed beside it as the reference
        seconds = 0.0 if rate is None else 4 * size / rate  # 4 pushes of each byte into its NIC
        reference = 0.0 if rate is None else 4 * size / FULL
        return replan.Window(tuple(readings), True, (0.0,) * 4 + (reference, seconds))

    def gap(rate):  # windows between its probes: a probe at `rate` costs the job its length
        return max(replan.PROBE_EVERY, math.ceil(4 * size / rate / replan.PROBE_SHARE / replan.WINDOW_S))

    def next_probe():  # windows up to its next probe
        start = follower.windows
        assert _until_probed(follower, tuple(readings)) == []
        assert follower.probes() == {5: size, 4: size}  # asked again: the same
        return follower.windows - start

    # A probe of 2.5 s at the planned rate: the first comes 100 windows (50 s) after the
    # follower's first; one whose time is not read, as long again after it.
    assert gap(FULL / 10) == 100 and next_probe() == 101 and next_probe() == 100
    # One probe is not a change; two are read together, their bytes over their seconds: 1.3x
    # then 4x read 1.96x of the planned rate, planned there (still too slow for a share). A
    # probe read gives its own gap, counted from it.
    assert follower.step(window(FULL / 10 * 1.3)) is None
    assert next_probe() == gap(FULL / 10 * 1.3) - 1
    assert follower.step(window(FULL / 10 * 4)) is None
    assert follower.planned[5] == pytest.approx(2 / (1 / 1.3 + 1 / 4) * FULL / 10) and follower.fractions[5] == 0
    assert next_probe() == gap(FULL / 10 * 4) - 1  # probes before that re-plan are of the rate it replaced
    assert follower.step(window(FULL / 10 * 4)) is None
    assert next_probe() == gap(FULL / 10 * 4) - 1
    split = follower.step(window(FULL / 10 * 4))
    assert split == pytest.approx(link_rate.fractions_for_rates(ROLES, [FULL] * 5 + [FULL / 10 * 4], 4))
    assert split[5] > 0.05 and follower.probes() == {}  # served again: read from its pushes from now on
    # A server left out at the full rate (it saves nothing) is never probed: it has nothing to come back from.
    follower = replan.RateFollower(ROLES, 4, [FULL] * 6, [0.25] * 4 + [0.0, 0.0])
    for _ in range(2 * replan.PROBE_EVERY):
        follower.step(window())
        assert follower.probes() == {}


def test_a_far_slower_left_out_servers_probe_is_no_longer_than_a_few_seconds_and_it_can_still_come_back():
    from jbps import link_rate

    # CPU host 5 at 1/500 of the full rate: sized for the full rate, its probe would take 125 s,
    # stalling the job's psums past their timeout. It takes LONGEST_PROBE_S at its planned rate.
    slow = [FULL] * 5 + [FULL / 500]
    fractions = link_rate.fractions_for_rates(ROLES, slow, 4)
    follower = replan.RateFollower(ROLES, 4, slow, fractions, timeout_s=60)
    readings = BASE[:5] + [0.0]
    assert _until_probed(follower, readings) == []
    probes = follower.probes()
    full_size = link_rate.server_probe_bytes(DEDICATED, 4, FULL, replan.PROBE_S)
    assert probes[4] == full_size  # the reference: sized for the full rate
    seconds = 4 * probes[5] / (FULL / 500)  # 4 pushes of each byte into its NIC
    assert seconds == pytest.approx(replan.LONGEST_PROBE_S, rel=0.01), seconds
    assert 4 * full_size / (FULL / 500) > 60  # what the full rate's size would have taken
    # Its link recovers: two small probes read it at a third of the full rate (a call's fixed
    # costs), far above its planned rate, and it is planned there: its next probe is larger.
    window = replan.Window(tuple(readings), True, (0.0,) * 4 + (4 * full_size / FULL, 3 * 4 * probes[5] / FULL))
    follower.step(window)
    assert follower.planned[5] == FULL / 500  # one probe is not a change
    assert _until_probed(follower, readings) == []
    follower.step(window)
    assert follower.planned[5] == pytest.approx(FULL / 3, rel=1e-3)
    # A shorter psum timeout caps it at a quarter of that timeout; one whose least probe
    # (SERVER_PROBE_MIN_BYTES) would take half the timeout is never probed.
    short = replan.RateFollower(ROLES, 4, [FULL] * 5 + [FULL / 200], fractions, timeout_s=8)
    assert _until_probed(short, readings) == []
    assert 4 * short.probes()[5] / (FULL / 200) == pytest.approx(2.0, rel=0.01)
    hopeless = replan.RateFollower(ROLES, 4, [FULL] * 5 + [FULL / 100_000], fractions, timeout_s=60)
    for _ in range(4 * replan.PROBE_EVERY):
        hopeless.step(replan.Window(tuple(readings), True))
        assert 5 not in hopeless.probes()


def test_a_server_still_left_out_after_a_probe_is_probed_on_until_it_reads_at_the_full_rate():
    from jbps import link_rate

    # Two workers, two CPU hosts; CPU host 3 at 0.3 of the full rate is left out (with two
    # workers a CPU host saves little, so one even 0.7 as fast gets no bytes).
    roles = [COLOCATED] * 2 + [DEDICATED] * 2
    planned = [FULL] * 3 + [0.3 * FULL]
    fractions = link_rate.fractions_for_rates(roles, planned, 2)
    assert fractions[3] == 0 and link_rate.fractions_for_rates(roles, [FULL] * 3 + [0.7 * FULL], 2)[3] == 0
    follower = replan.RateFollower(roles, 2, planned, fractions)
    size = link_rate.server_probe_bytes(DEDICATED, 2, FULL, replan.PROBE_S)
    probed = []

    def probe(rate, links=1.0):  # windows up to the next probe, then the window that brings its time
        assert _until_probed(follower, (30e6, 30e6, 60e6, 0.0)) == []
        probed.append(follower.probes())
        # The job's psums leave the probes `links` of the workers' links: CPU host 3's probe and
        # that of CPU host 2 (the reference, serving at the full rate) alike.
        seconds = (0.0, 0.0, 2 * size / (FULL * links), 2 * size / (rate * links))
        return follower.step(replan.Window((30e6, 30e6, 60e6, 0.0), True, seconds))

    # Read twice at 0.6: twice the planned rate, planned again there, still without bytes.
    assert probe(0.6 * FULL) is None and probe(0.6 * FULL) is None
    assert follower.planned[3] == pytest.approx(0.6 * FULL) and follower.fractions[3] == 0
    # Probed on: 0.8 is neither 1.5x of 0.6 nor the full rate within the probe's error.
    assert probe(0.8 * FULL) is None and probe(0.8 * FULL) is None and follower.planned[3] == pytest.approx(0.6 * FULL)
    # 0.92 is the full rate as the probe reads it: the split of equal links, its share back.
    assert probe(0.92 * FULL) is None
    split = probe(0.92 * FULL)
    assert probed == [{3: size, 2: size}] * 6
    assert split == pytest.approx(server_fractions(roles, 2)) and split[3] > 0.3
    assert follower.planned[3] == pytest.approx(0.92 * FULL)

    # Probes that the job's psums slow to 0.6 of the links read a recovered host at the full
    # rate against the reference beside them (alone, at 0.6 of it: too slow for a share).
    follower = replan.RateFollower(roles, 2, planned, fractions)
    assert probe(FULL, links=0.6) is None
    split = probe(FULL, links=0.6)
    assert split == pytest.approx(server_fractions(roles, 2)) and follower.planned[3] == pytest.approx(FULL)


def test_the_probes_order_turns_round_so_that_a_recovered_server_probed_first_comes_back():
    # On CI's machine a recovered CPU host probed before its reference read 0.93 of it (the
    # first probe meets the job's chunks in flight) and never came back. Here the first
    # probe of every pair takes 1.2x: the order turns round at every probe, and over two
    # probes running each server pays it once.
    follower, size = _two_worker_follower([FULL, FULL, 0.3 * FULL, FULL])  # CPU host 2 left out, 3 its reference
    assert follower.fractions[2] == 0
    steady = (30e6, 30e6, 0.0, 60e6)
    orders, splits = [], []
    for _ in range(2):
        assert _until_probed(follower, steady) == []
        orders.append(list(follower.probes()))
        seconds = [0.0] * 4
        for place, s in enumerate(orders[-1]):
            seconds[s] = 2 * size / FULL * (1.2 if place == 0 else 1.0)
        splits.append(follower.step(replan.Window(steady, True, tuple(seconds))))
    assert sorted(orders[0]) == [2, 3] and orders[1] == orders[0][::-1]
    assert splits[0] is None and splits[1] is not None and splits[1][2] > 0.3
    assert follower.planned[2] == pytest.approx(FULL)


def test_a_left_out_cpu_host_with_no_other_serving_is_read_against_a_worker_machines_server():
    from jbps import link_rate

    # Two workers, one CPU host, left out at 0.3 of the full rate; its link recovers. No CPU
    # host serves to probe beside it, so a worker machine's serving server is the reference,
    # its probe sized for its role; the job's psums leave both probes 0.8 of the links, which
    # alone reads the CPU host below the full rate within the probe's error.
    roles = [COLOCATED] * 2 + [DEDICATED]
    planned = [FULL] * 2 + [0.3 * FULL]
    fractions = link_rate.fractions_for_rates(roles, planned, 2)
    assert fractions[2] == 0
    follower = replan.RateFollower(roles, 2, planned, fractions)
    size = link_rate.server_probe_bytes(DEDICATED, 2, FULL, replan.PROBE_S)
    ref_size = link_rate.server_probe_bytes(COLOCATED, 2, FULL, replan.PROBE_S)
    splits = []
    for _ in range(replan.PROBES_TO_CHANGE):
        splits += _until_probed(follower, (30e6, 30e6, 0.0))
        assert follower.probes() == {2: size, 0: ref_size}
        seconds = (ref_size / (0.8 * FULL), 0.0, 2 * size / (0.8 * FULL))  # each NIC's bytes at 0.8
        splits.append(follower.step(replan.Window((30e6, 30e6, 0.0), True, seconds)))
    assert splits[:-1] == [None] * (len(splits) - 1) and splits[-1][2] > 0.3
    assert follower.planned[2] == pytest.approx(FULL)
    # A server planned far above the full rate is no reference: the host would read as high.
    planned = [9 * FULL, FULL, 0.3 * FULL]
    follower = replan.RateFollower(roles, 2, planned, link_rate.fractions_for_rates(roles, planned, 2))
    _until_probed(follower, (30e6, 30e6, 0.0))
    assert follower.probes() == {2: size, 1: ref_size}


def _two_worker_follower(planned):
    from jbps import link_rate

    roles = [COLOCATED] * 2 + [DEDICATED] * 2
    fractions = link_rate.fractions_for_rates(roles, planned, 2) or server_fractions(roles, 2)  # None: the formula's
    follower = replan.RateFollower(roles, 2, planned, fractions)
    return follower, link_rate.server_probe_bytes(DEDICATED, 2, FULL, replan.PROBE_S)


def _until_probed(follower, readings):
    """Windows of these readings up to the next probe; the splits they gave."""
    splits = []
    for _ in range(1000):
        splits.append(follower.step(replan.Window(readings, True)))
        if follower.probes():
            return [s for s in splits if s is not None]
    raise AssertionError("no probe in 1,000 windows")


def test_a_left_out_servers_probes_running_stand_through_a_re_plan_for_another_server():
    # CPU host 3 at 0.3 of the full rate, left out; its link recovers. A probe reads it at
    # the full rate, then worker machine 0 slows and is re-planned, then a second probe reads
    # it at the full rate again: two probes running, its share back. (A re-plan used to
    # restart every probe count: a job whose readings moved something between every two
    # probes never brought a recovered server back.)
    follower, size = _two_worker_follower([FULL] * 3 + [0.3 * FULL])
    steady = (30e6, 30e6, 60e6, 0.0)
    recovered = (0.0, 0.0, 2 * size / FULL, 2 * size / FULL)  # beside CPU host 2, the reference
    assert _until_probed(follower, steady) == []
    assert follower.step(replan.Window(steady, True, recovered)) is None and len(follower.probe_reads[3]) == 1
    slow0 = (10e6,) + steady[1:]
    moved = [follower.step(replan.Window(slow0, True)) for _ in range(replan.WINDOWS_TO_CHANGE)]
    assert moved[-1] is not None and follower.planned[0] < FULL / 2  # server 0's own change
    assert _until_probed(follower, slow0) == []
    back = follower.step(replan.Window(slow0, True, recovered))
    assert back is not None and back[3] > 0.2 and follower.planned[3] == pytest.approx(FULL)


def test_a_server_left_out_for_a_slowdown_is_probed_even_when_its_planned_rate_is_near_the_full_one():
    # Init read CPU host 3 at 1.5x the others; its link then reads at 0.6 of its baseline:
    # planned at 0.9 of the full rate (within the probe's error of it), and with two workers
    # left out. It is probed all the same, and comes back once two probes read it at the full rate.
    follower, size = _two_worker_follower([FULL] * 3 + [1.5 * FULL])
    assert follower.fractions[3] > 0
    base = (30e6, 30e6, 40e6, 40e6)
    for _ in range(replan.BASELINE_WINDOWS):
        assert follower.step(replan.Window(base, True)) is None
    slow = base[:3] + (0.6 * base[3],)
    moved = [follower.step(replan.Window(slow, True)) for _ in range(replan.WINDOWS_TO_CHANGE)]
    assert moved[-1] is not None and moved[-1][3] == 0 and follower.planned[3] == pytest.approx(0.9 * FULL)
    steady = (30e6, 30e6, 60e6, 0.0)
    recovered = (0.0, 0.0, 2 * size / FULL, 2 * size / FULL)
    assert _until_probed(follower, steady) == [] and follower.probes() == {3: size, 2: size}
    assert follower.step(replan.Window(steady, True, recovered)) is None
    assert _until_probed(follower, steady) == []
    back = follower.step(replan.Window(steady, True, recovered))
    assert back is not None and back[3] > 0.2


def test_the_agreed_window_takes_per_server_the_median_of_the_workers_that_reach_it_over_the_network():
    # Worker 0 on a slow link of its own reads every server slow; the others
    # read server 0 (worker 0's machine) slow; worker 0 reaches its own server
    # through shared memory (no reading). Worker 2 has not seen the last split yet.
    matrix = np.array(
        [
            [0, 8, 8, 8, 9, 9],
            [10, 0, 30, 30, 40, 40],
            [10, 30, 0, 30, 40, 40],
            [10, 30, 30, 0, 40, 40],
        ],
        np.float32,
    )
    window = replan.agreed_window(matrix, np.array([1, 1, 0, 1], np.float32))
    assert window.readings == (10, 30, 30, 30, 40, 40)
    assert not window.settled
    # The others waiting on worker 0 (their pushes done) read nothing of servers 4 and 5 but
    # one: read by fewer than half the workers, those servers are no news, not slow.
    matrix[2:, 4:] = 0
    matrix[1, 5] = 0
    assert replan.agreed_window(matrix, np.ones(4, np.float32)).readings == (10, 30, 30, 30, 24.5, 0)
    # Probe times: per server the fastest worker's (the sum waited for the last to start).
    probes = np.array([[0, 0.3], [0, 0.2], [0, 0.5], [0, 0.25]], np.float32)
    assert replan.agreed_window(matrix, np.ones(4, np.float32), probes).probes == pytest.approx((0.0, 0.2))
    # Mean push sizes: the median of the workers' that pushed (0: too few pushes to say).
    sizes = np.array([5700, 0, 300, 5900], np.float32)
    assert replan.agreed_window(matrix, np.ones(4, np.float32), sizes=sizes).push_bytes == 5700


def test_a_worker_machine_that_slows_is_read_from_its_own_workers_readings_and_followed_back_without_probes():
    # Worker machine 0's link drops to 0.4: its worker reads every server slow, while the
    # others, waiting on it, give its server no reading (no news by its column). Its link,
    # read from its worker's fastest reading against the other workers', moves the split.
    follower = _follower()
    links = [40e6] * 4 + [0.0, 0.0]  # each worker machine's link as its worker reads it

    for _ in range(replan.BASELINE_WINDOWS):
        assert follower.step(_window(BASE, links=links)) is None
    slow = [0.4 * links[0]] + links[1:]
    unread = [0.0] + BASE[1:]
    moved = [follower.step(_window(unread, links=slow)) for _ in range(replan.WINDOWS_TO_CHANGE - 1)]
    # A window where its worker alone read its link (the others, waiting on it, pushed too
    # little) is no news: the slowdown's windows running stand.
    alone = [0.4 * links[0]] + [0.0] * 5
    assert follower.step(_window([0.0] * 6, links=alone)) is None
    moved.append(follower.step(_window(unread, links=slow)))
    assert moved[:-1] == [None] * (replan.WINDOWS_TO_CHANGE - 1) and moved[-1] is not None
    assert follower.planned[0] == pytest.approx(0.4 * FULL) and moved[-1][0] == 0  # τ* is its own M's time now
    # The others, no longer sharing the servers' links with its pushes, read faster meanwhile:
    # that is no measure of its link.
    faster = _follower()
    for _ in range(replan.BASELINE_WINDOWS):
        faster.step(_window(BASE, links=links))
    others_faster = [0.4 * links[0]] + [1.5 * r for r in links[1:4]] + [0.0, 0.0]
    assert [faster.step(_window(unread, links=others_faster)) for _ in range(replan.WINDOWS_TO_CHANGE)][-1] is not None
    assert faster.planned[0] == pytest.approx(0.4 * FULL)
    # On the new split: a baseline, then its link comes back; read the same way, never probed.
    after = [moved[-1][s] * 120e6 if moved[-1][s] > 0 else 0.0 for s in range(6)]
    for _ in range(replan.BASELINE_WINDOWS):
        assert follower.step(_window(after, links=slow)) is None and follower.probes() == {}
    back = [follower.step(_window(after, links=links)) for _ in range(replan.WINDOWS_TO_CHANGE)]
    assert back[-1] is not None and follower.planned[0] == pytest.approx(FULL)
    assert back[-1] == pytest.approx(server_fractions(ROLES, 4))
    for _ in range(2 * replan.PROBE_EVERY):  # never probed on the way
        follower.step(_window(after, links=slow))
        assert follower.probes() == {}
    # Where its pushers read it too, it runs at the least slow of the readings that saw the
    # slowdown: its worker's link reads a slowed machine low.
    follower = _follower()
    for _ in range(replan.BASELINE_WINDOWS):
        follower.step(_window(BASE, links=links))
    column = [0.4 * BASE[0]] + BASE[1:]
    very = [0.2 * links[0]] + links[1:]
    moved = [follower.step(_window(column, links=very)) for _ in range(replan.WINDOWS_TO_CHANGE)]
    assert moved[-1] is not None and follower.planned[0] == pytest.approx(0.4 * FULL)


def test_a_quieter_phase_or_a_slow_server_elsewhere_is_no_worker_machines_slowdown():
    follower = _follower()
    links = [40e6] * 4 + [0.0, 0.0]
    for _ in range(replan.BASELINE_WINDOWS):
        follower.step(_window(BASE, links=links))
    quiet = _window([b / 3 for b in BASE], links=[r / 3 for r in links])
    assert all(follower.step(quiet) is None for _ in range(2 * replan.WINDOWS_TO_CHANGE))
    # The agreed window: a worker's link is its fastest reading, so CPU host 5 read slow by
    # everyone slows no worker machine's link; a worker with a single reading gives none.
    matrix = np.array([[0, 30, 31, 29, 30, 6], [30, 0, 29, 31, 30, 6], [10, 0, 0, 0, 0, 0], [8, 8, 8, 0, 8, 2]])
    window = replan.agreed_window(matrix.astype(np.float32), np.ones(4), own=np.array([0, 1, 2, 3]))
    assert window.links == (31, 31, 0, 8, 0, 0)
    # Shared memory tells a worker its own server: the one colocated server it reaches through it.
    assert replan.own_server(ROLES, [0, 0, 1, 0, 0, 0]) == 2
    assert replan.own_server(ROLES, [0, 0, 0, 0, 1, 0]) == -1 and replan.own_server(ROLES, [0] * 6) == -1


def test_readings_leave_out_idle_and_shared_memory_servers():
    few = replan.MIN_READ_PUSHES - 1
    before = {
        "server_bytes_acked": [0, 0, 0, 0],
        "server_chunks_acked": [0, 0, 0, 0],
        "server_unacked_seconds": [0, 0, 0, 0],
        "server_shared_memory": [0, 0, 1, 0],
    }
    after = {
        "server_bytes_acked": [100, 0, 100, 100],
        "server_chunks_acked": [few + 1, 0, few + 1, few],
        "server_unacked_seconds": [0.5, 0, 0.001, 0.1],
        "server_shared_memory": [0, 0, 1, 0],
    }
    # Server 3's few pushes (a call's last, alone on the links or waiting long) are no reading.
    assert replan.readings(before, after) == [200.0, 0.0, 0.0, 0.0]
