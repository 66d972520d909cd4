"""The optimal split, byte-balanced routing, priorities and `jbps plan`,
checked against first-principles traffic counts and published formulas."""

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from jbps.partition import (
    defaults,
    COLOCATED,
    DEDICATED,
    assign_chunks,
    forward_order,
    make_plan,
    optimal_split,
    resolve_priorities,
    server_fractions,
)
from jbps.partition.__main__ import main as plan_main
from jbps.partition.traffic import busiest_nic_bytes, standard_placement

M, B = 1000.0, 10.0


def split_fractions(n, k):
    s = optimal_split(n, k)
    return [s.colocated_fraction] * n + [s.cpu_fraction] * k


@pytest.mark.parametrize("n,k", [(n, k) for n in range(1, 9) for k in range(0, 11)])
def test_split_sums_to_one_and_matches_busiest_link(n, k):
    fractions = split_fractions(n, k)
    assert sum(fractions) == pytest.approx(1.0)
    assert min(fractions) >= 0
    busiest = busiest_nic_bytes(n, standard_placement(n, k), [f * M for f in fractions])
    assert busiest == pytest.approx(optimal_split(n, k).time_s(M, B) * B)


def test_split_ends_are_allreduce_and_ps():
    for n in range(2, 10):
        assert optimal_split(n, 0).time_s(M, B) == pytest.approx(2 * (n - 1) * M / (n * B))
        assert optimal_split(n, n).time_s(M, B) == pytest.approx(M / B)
        assert optimal_split(n, 2 * n).time_s(M, B) == pytest.approx(M / B)  # k > n: bounded by the worker NIC


def test_split_is_optimal_among_alternatives():
    # No other (x, y) on k·x + n·y = 1 loads the busiest NIC less.
    rng = random.Random(0)
    for _ in range(200):
        n, k = rng.randint(2, 8), rng.randint(1, 10)
        best = optimal_split(n, k).time_s(M, B) * B
        y = rng.uniform(0, 1 / n)
        x = (1 - n * y) / k
        other = busiest_nic_bytes(n, standard_placement(n, k), [y * M] * n + [x * M] * k)
        assert other >= best * (1 - 1e-9)


@pytest.mark.parametrize("n,k", [(n, k) for n in range(2, 9) for k in range(0, 11)])
def test_the_link_probe_counts_the_busiest_nic_as_the_formula_does(n, k):
    # jbps.init's rate is the probe's bytes on the busiest NIC over its time:
    # for the optimal split, the formula's T·B per byte, whatever the order
    # in which the servers are listed.
    from jbps.link_rate import busiest_nic_share

    roles = [COLOCATED] * n + [DEDICATED] * k
    random.Random(n * 100 + k).shuffle(roles)
    fractions = server_fractions(roles, n)
    assert busiest_nic_share(roles, fractions, n) == pytest.approx(optimal_split(n, k).time_s(1.0, 1.0))


def test_the_link_probes_rate_lets_fixed_costs_cancel_and_bounds_a_chance_slow_or_quick_probe():
    # Probes doubling in size on a link of 100 bytes/s with 0.05 s of fixed
    # costs per call; the busiest NIC carries half of each probe's bytes.
    from jbps.link_rate import MAX_FIXED_SHARE, rate_from_probes

    link, fixed, share = 100.0, 0.05, 0.5
    timed = [(b, fixed + share * b / link) for b in (8, 16, 32, 64)]
    assert rate_from_probes(timed, share) == pytest.approx(link)  # the fixed costs cancel
    assert rate_from_probes(timed, share) > share * 64 / timed[-1][1]  # which the whole call counts
    # The smaller call quick by chance (a burst): never below what the whole last call gives.
    quick = timed[:-2] + [(32, 0.01), timed[-1]]
    assert rate_from_probes(quick, share) == pytest.approx(share * 64 / timed[-1][1])
    # The smaller call slow by chance (a busy CPU): the difference would read 4x the link.
    slow = timed[:-2] + [(32, timed[-1][1] - share * 32 / (4 * link)), timed[-1]]
    whole = share * 64 / timed[-1][1]
    assert rate_from_probes(slow, share) == pytest.approx(whole / (1 - MAX_FIXED_SHARE))
    assert rate_from_probes(slow, share) < 1.5 * link
    # One probe only (the first took PROBE_MIN_S): its bytes over its time.
    assert rate_from_probes([(64, 0.5)], share) == pytest.approx(share * 64 / 0.5)


def test_a_server_probe_grows_until_it_takes_about_its_aim_on_that_servers_own_link():
    # jbps.init sizes each server's probe from the busiest link's rate; on a
    # link 10x faster than that (a slow spare host set it) the probe must grow
    # until it takes about SERVER_PROBE_S there, by doublings, at most
    # SERVER_PROBE_GROWTH per resizing, and stop at PROBE_MAX_BYTES.
    from jbps.link_rate import (
        PROBE_MAX_BYTES,
        SERVER_PROBE_GROWTH,
        SERVER_PROBE_S,
        SERVER_PROBE_SHORT,
        resized_probe,
    )

    link, fixed = 37.5e6, 0.001  # bytes/s, seconds of a call's own costs

    def took(nbytes):
        return fixed + nbytes / link

    nbytes, resizings = 256 << 10, 0
    while (grown := resized_probe(nbytes, took(nbytes))) != nbytes:
        assert grown in (2 * nbytes, 4 * nbytes, 8 * nbytes) and grown <= SERVER_PROBE_GROWTH * nbytes
        nbytes, resizings = grown, resizings + 1
    assert SERVER_PROBE_SHORT * SERVER_PROBE_S <= took(nbytes) < 2 * SERVER_PROBE_S, (nbytes, took(nbytes))
    assert resizings == 1  # 256 KiB took 8 ms: 8x at once
    # A probe already long enough, or at the largest size, stays.
    assert resized_probe(1 << 20, SERVER_PROBE_S) == 1 << 20
    assert resized_probe(PROBE_MAX_BYTES, 0.001) == PROBE_MAX_BYTES
    # A probe read near zero (a burst let it through) grows by SERVER_PROBE_GROWTH, not more.
    assert resized_probe(256 << 10, 1e-6) == SERVER_PROBE_GROWTH * (256 << 10)
    assert resized_probe(PROBE_MAX_BYTES // 2, 1e-6) == PROBE_MAX_BYTES


def test_split_rejects_bad_counts():
    with pytest.raises(ValueError, match="num_workers"):
        optimal_split(0, 1)
    with pytest.raises(ValueError, match="num_cpu_servers"):
        optimal_split(2, -1)


def random_tree_plan(rng, n, k, partition, shards=1, name="t", groups=1):
    count = rng.randint(1, 40)
    paths = [f"['layer{i}']" for i in range(count)]
    shapes = [(rng.randint(1, 300_000),) for _ in range(count)]
    dtypes = [rng.choice([np.float32, np.float16, np.float64]) for _ in range(count)]
    roles = [COLOCATED] * n + [DEDICATED] * k
    return make_plan(
        name,
        paths,
        shapes,
        dtypes,
        shards,
        partition_bytes=partition,
        server_fractions=server_fractions(roles, n),
        num_groups=groups,
    ), roles


@pytest.mark.parametrize("seed", range(20))
def test_routing_hits_fractions_within_one_partition(seed):
    rng = random.Random(seed)
    n, k = rng.randint(1, 6), rng.randint(0, 6)
    partition = rng.choice([4096, 65536, 1 << 20])
    plan, roles = random_tree_plan(rng, n, k, partition, shards=rng.randint(1, 4), groups=rng.randint(1, 3))
    per_server = plan.server_bytes(len(roles))
    total = sum(per_server)
    assert total == sum(leaf.shard_bytes * plan.num_shards * plan.num_groups for leaf in plan.leaves)
    for got, fraction in zip(per_server, server_fractions(roles, n)):
        assert abs(got - fraction * total) <= partition, (got, fraction * total)


def test_groups_get_slots_of_their_own_and_split_leaves_over_the_reduced_devices_only():
    # 2 devices reduce together, 3 such groups (a psum over one axis of a 2x3 mesh).
    plan = make_plan(
        "g", ["['w']"], [(10,)], [np.float32], 2, num_groups=3, partition_bytes=8, server_fractions=[0.5, 0.5]
    )
    leaf = plan.leaves[0]
    assert (leaf.padded, leaf.shard_bytes, leaf.num_chunks) == (10, 20, 3)  # 5 floats a device, 2 a chunk
    assert plan.num_slots == 6
    assert [slot for slot, *_ in plan.chunks()] == [slot for slot in range(6) for _ in range(3)]
    assert len(plan.chunk_servers) == 6 * 3


def test_greedy_bound_on_adversarial_sizes():
    sizes = [1000] * 7 + [999, 1, 1, 1]
    owner = assign_chunks(sizes, list(range(len(sizes))), [0.5, 0.3, 0.2])
    for s, f in enumerate([0.5, 0.3, 0.2]):
        got = sum(b for b, o in zip(sizes, owner) if o == s)
        assert abs(got - f * sum(sizes)) <= max(sizes)


def test_routing_ignores_dict_order():
    import jax

    a = {"b": np.zeros(70_000, np.float32), "a": np.zeros((300, 700), np.float32), "c": np.zeros(5, np.float16)}
    b = dict(reversed(list(a.items())))
    plans = []
    for tree in (a, b):
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        plans.append(
            make_plan(
                "x",
                [jax.tree_util.keystr(p) for p, _ in flat],
                [v.shape for _, v in flat],
                [v.dtype for _, v in flat],
                2,
                partition_bytes=65536,
                server_fractions=server_fractions([COLOCATED] * 2 + [DEDICATED], 2),
            )
        )
    assert plans[0] == plans[1]


ROUTING_SCRIPT = """
import json, random, numpy as np
from jbps.partition import make_plan, server_fractions
rng = random.Random(7)
paths = [f"['p{i}']" for i in range(30)]
shapes = [(rng.randint(1, 100000),) for _ in paths]
plan = make_plan("net", paths, shapes, [np.float32] * 30, 2, partition_bytes=32768, server_fractions=server_fractions(["colocated"] * 3 + ["dedicated"] * 2, 3))
print(json.dumps([[l.key for l in plan.leaves], list(plan.chunk_servers)]))
"""


def test_routing_identical_across_processes(tmp_path):
    outputs = set()
    for seed in ("1", "2", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        # cwd: not the checkout, whose unbuilt sources `-c` would import first.
        out = subprocess.run(
            [sys.executable, "-c", ROUTING_SCRIPT], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
        )
        assert out.returncode == 0, out.stderr[-3000:]
        outputs.add(out.stdout.strip().splitlines()[-1])
    assert len(outputs) == 1


def test_many_small_calls_spread_over_servers():
    servers = set()
    for i in range(40):
        plan = make_plan(
            f"call{i}", ["['w']"], [(10,)], [np.float32], 1, partition_bytes=4096, server_fractions=[0.25] * 4
        )
        servers.update(plan.chunk_servers)
    assert servers == {0, 1, 2, 3}


def test_priority_mapping_callable_and_errors():
    paths, leaves = ["['a']", "['b']", "['c']"], [np.zeros(1)] * 3
    assert resolve_priorities(paths, leaves, None) is None
    assert resolve_priorities(paths, leaves, {"['c']": 10}) == [0, -1, 10]
    assert resolve_priorities(paths, leaves, lambda p, x: paths.index(p)) == [0, 1, 2]
    with pytest.raises(ValueError, match=r"\['zz'\]"):
        resolve_priorities(paths, leaves, {"['zz']": 1})
    with pytest.raises(TypeError, match=r"\['b'\]"):
        resolve_priorities(paths, leaves, lambda p, x: 1.5 if p == "['b']" else 0)
    with pytest.raises(TypeError, match="mapping"):
        resolve_priorities(paths, leaves, 3)


def test_forward_order_follows_insertion_not_sorted_keys():
    params = {"params": {"Dense_2": {"kernel": 1, "bias": 2}, "Dense_10": {"kernel": 3}, "Conv_0": {"w": 4}}}
    order = forward_order(params)
    ranked = sorted(order, key=order.get, reverse=True)
    assert ranked == [
        "['params']['Dense_2']['kernel']",
        "['params']['Dense_2']['bias']",
        "['params']['Dense_10']['kernel']",
        "['params']['Conv_0']['w']",
    ]


def test_plan_cli_table_json_and_plot(tmp_path, capsys):
    assert plan_main(["resnet50", "-n", "4", "-k", "0-4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["k"] for r in report["rows"]] == [0, 1, 2, 3, 4]
    for r in report["rows"]:
        M_bytes = r["model_bytes"]
        assert M_bytes == 25_557_032 * 4
        n, k = 4, r["k"]
        bw = 100e9 / 8
        formula = 2 * n * (n - 1) * M_bytes / ((n * n + k * n - 2 * k) * bw)
        assert r["formula_s"] == pytest.approx(formula)
        # The actual routing is within one partition per server of the formula's load.
        assert r["jbps_s"] <= formula + n * 4 * 2**20 / bw
        assert r["allreduce_s"] == pytest.approx(2 * (n - 1) * M_bytes / (n * bw))
    png = tmp_path / "plan.png"
    assert plan_main(["vgg16", "-n", "2", "--plot", str(png)]) == 0
    table = capsys.readouterr().out
    assert "all-reduce ms" in table and table.count("\n") >= 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_cli_chunks_follow_the_bandwidth(capsys):
    # jbps picks chunks by the link's measured rate; the plan by the rate given.
    chunks = {}
    for gbit in (0.2, 1.0, 100.0):
        assert plan_main(["resnet50", "-n", "4", "-k", "0", "--bandwidth", str(gbit), "--json"]) == 0
        chunks[gbit] = json.loads(capsys.readouterr().out)["rows"][0]["partition_bytes"]
    assert chunks[0.2] <= 0.2e9 / 8 * defaults.CHUNK_LINK_S < chunks[1.0]
    assert chunks[1.0] <= 1e9 / 8 * defaults.CHUNK_LINK_S < chunks[100.0]


def test_plan_cli_rejects_unknown_model(capsys):
    with pytest.raises(SystemExit):
        plan_main(["no-such-model"])
    assert "no-such-model" in capsys.readouterr().err


@pytest.mark.parametrize("seed", range(5))
def test_the_plan_cuts_shards_into_whole_elements_within_a_partition(seed):
    # The plan is the one chunk table: the engine cuts by it (CheckChunkTable
    # refuses one that does not add up, tests/test_errors.py). For every dtype
    # and partition its chunks tile each shard in whole elements.
    import jax.numpy as jnp

    from jbps.ops import onebit, topk

    dtypes = {
        "float32": np.float32,
        "float64": np.float64,
        "float16": np.float16,
        "bfloat16": jnp.bfloat16,
        "int32": np.int32,
        "onebit": onebit.RECORD_DTYPE,
        "topk": None,  # records of a random keep, which sizes them
    }
    rng = random.Random(seed)
    ramped = 0
    for _ in range(200):
        name = rng.choice(sorted(dtypes))
        param = rng.choice([1, 10, 51, 333, 512]) if name == "topk" else 0
        dtype = topk.codec(param).RECORD_DTYPE if name == "topk" else dtypes[name]
        partition = rng.choice([1, 3, 7, 40, 4096, 65536, 1 << 20, rng.randint(1, 1 << 22)])
        shards = rng.randint(1, 4)
        size = rng.randint(1, min(300_000, 64 * partition))  # a few chunks a shard: the plan lists each
        ramp = rng.random() < 0.5
        if ramp and rng.random() < 0.5:  # long enough for the ramps, often
            least = 8 * partition * shards // np.dtype(dtype).itemsize
            size = rng.randint(max(1, least - shards), least + 4 * partition)
        plan = make_plan(
            "c", ["['w']"], [(size,)], [dtype], shards, partition_bytes=partition, server_fractions=[1.0], ramp=ramp
        )
        leaf = plan.leaves[0]
        what = (name, partition, size, param, ramp)
        itemsize = np.dtype(dtype).itemsize
        # A chunk is as many whole elements as fit a partition (at least one).
        assert leaf.chunk_bytes % itemsize == 0 and leaf.chunk_bytes <= max(partition, itemsize), what
        assert leaf.chunk_bytes + itemsize > partition or leaf.chunk_bytes == itemsize, what
        sizes, counts, alone = plan.chunk_table([0])
        assert sizes == leaf.chunk_sizes() and counts == [leaf.num_chunks] == [len(sizes)] == [len(alone)], what
        # The chunks tile the shard, none empty, none over a partition, each whole elements.
        assert sum(sizes) == leaf.shard_bytes and all(0 < b <= leaf.chunk_bytes for b in sizes), what
        assert all(b % itemsize == 0 for b in sizes), what
        # A ramp's pieces (the first and last four) travel alone; nothing else does.
        if leaf.ramped:
            assert sizes[:4] == [leaf.chunk_bytes // 8 * e for e in (1, 1, 2, 4)] == sizes[-4:][::-1], what
            assert alone == [True] * 4 + [False] * (len(sizes) - 8) + [True] * 4, what
        else:
            assert not any(alone), what
        ramped += leaf.ramped
    assert ramped > 10  # the ramps were exercised, not only the plain cut


def test_the_rated_split_with_equal_rates_is_the_formulas():
    from jbps.partition.rated_split import rated_split
    from jbps.partition.split import optimal_split

    for n in range(1, 9):
        for k in range(0, 10):
            roles = ["colocated"] * n + ["dedicated"] * k
            got = rated_split(roles, [125e6] * len(roles), n)
            np.testing.assert_allclose(got.fractions, server_fractions(roles, n), atol=1e-9, err_msg=f"n={n} k={k}")
            if n > 1:
                assert got.time_s(1 << 20) == pytest.approx(optimal_split(n, k).time_s(1 << 20, 125e6), rel=1e-9)


def test_the_rated_split_finishes_every_link_together_and_beats_leaving_a_slow_host_out():
    from jbps.partition.rated_split import rated_split
    from jbps.partition.split import optimal_split
    from jbps.partition.traffic import nic_bytes, standard_placement

    B, M = 125e6, 32 << 20
    roles = ["colocated"] * 4 + ["dedicated"] * 2
    rates = [B] * 4 + [B, 0.4 * B]  # one CPU host at 400 of 1,000 Mbit/s
    split = rated_split(roles, rates, 4)
    loads = nic_bytes(4, standard_placement(4, 2), [f * M for f in split.fractions])
    times = [loads[m] / rates[m] for m in range(6)]
    assert max(times) == pytest.approx(split.time_s(M), rel=1e-6)
    assert min(times) == pytest.approx(max(times), rel=1e-6)  # every link busy to the end
    # Better than leaving the slow host out, worse than both at full rate.
    assert optimal_split(4, 2).time_s(M, B) < split.time_s(M) < optimal_split(4, 1).time_s(M, B)
    assert split.fractions[5] == pytest.approx(0.4 * split.fractions[4], rel=1e-6)  # shares by rate


def test_a_worker_machine_too_slow_for_its_own_traffic_gets_no_share_and_sets_the_time():
    from jbps.partition.rated_split import rated_split

    B = 125e6
    split = rated_split(["colocated"] * 4 + ["dedicated"] * 2, [B, B, B, 0.4 * B, B, B], 4)
    assert split.fractions[3] == 0.0 and sum(split.fractions) == pytest.approx(1.0)
    assert split.time_s(1.0) == pytest.approx(1 / (0.4 * B))  # its own gradient out, nothing more


def test_rated_split_and_host_rates_refuse_bad_input_in_one_line():
    from jbps.partition.rated_split import parse_host_rates, rated_split

    with pytest.raises(ValueError, match="2 roles and 1 rates"):
        rated_split(["colocated", "dedicated"], [1.0], 2)
    with pytest.raises(ValueError, match="server 1's rate must be a non-negative number"):
        rated_split(["colocated", "dedicated"], [1.0, -5.0], 2)
    assert parse_host_rates("s1=400M, w0=800M", 4, 2) == {5: 400e6, 0: 800e6}
    for text, why in [
        ("s2=400M", "names no machine: there are at most 2 CPU machines"),
        ("w4=1G", "names no machine: there are 4 worker machines"),
        ("x1=1G", "is not w<i>=RATE"),
        ("s0=fast", "is not a number of bits per second"),
        ("s0", "is not w<i>=RATE"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_host_rates(text, 4, 2)


def test_plan_cli_follows_per_machine_rates(capsys):
    def rows(*rates):
        plan_main(["resnet50", "--workers", "4", "--cpu-servers", "2", "--bandwidth", "1", "--json", *rates])
        (row,) = json.loads(capsys.readouterr().out)["rows"]
        return row

    equal, slow, slower = rows(), rows("--rates", "s1=400M"), rows("--rates", "s1=200M")
    assert equal["formula_s"] < slow["formula_s"] < slower["formula_s"]
    assert slow["jbps_s"] <= slow["formula_s"] * 1.05
    assert 0 < slow["dedicated_bytes"][1] < 0.5 * slow["dedicated_bytes"][0]  # the slow machine gets less
    # At 200 Mbit/s it would save 2%: it gets nothing, and the plan is the k = 1 formula's.
    assert slower["dedicated_bytes"][1] == 0
    assert slower["jbps_s"] == pytest.approx(optimal_split(4, 1).time_s(slower["model_bytes"], 125e6), rel=0.01)
    with pytest.raises(SystemExit):
        plan_main(["resnet50", "--workers", "4", "--cpu-servers", "2", "--rates", "s5=1G"])
    assert "names no machine" in capsys.readouterr().err


def test_measured_rates_near_the_jobs_full_rate_count_as_it():
    from jbps.link_rate import fractions_for_rates
    from jbps.partition.rated_split import rated_split

    B = 125e6
    roles = ["colocated"] * 4 + ["dedicated"] * 2
    # The probe's noise on alike links (one reading high, worker machines within
    # 1.3x of the median, CPU machines within 1.12x): the formula's split.
    assert fractions_for_rates(roles, [B, 0.8 * B, B, 1.25 * B, 0.92 * B, B], 4) is None
    # A CPU machine read 20% below the others keeps its reading (an equal share
    # would make it every psum's slowest link); the high reading counts as the rest.
    got = fractions_for_rates(roles, [B, 0.8 * B, B, 1.25 * B, B, 0.8 * B], 4)
    np.testing.assert_allclose(got, rated_split(roles, [B] * 5 + [0.8 * B], 4).fractions, atol=1e-12)
    # A worker machine clearly slower keeps its reading too.
    got = fractions_for_rates(roles, [B, B, 0.5 * B, B, B, B], 4)
    np.testing.assert_allclose(got, rated_split(roles, [B, B, 0.5 * B, B, B, B], 4).fractions, atol=1e-12)
    # With two workers a CPU machine's share is a tie (it saves nothing, costs
    # nothing): one read a little low keeps its reading's share, one clearly
    # slower is left out. Read 0.8 of the median with the other at 0.3:
    two = ["colocated"] * 2 + ["dedicated"] * 2
    got = fractions_for_rates(two, [B, B, 0.8 * B, 0.3 * B], 2)
    full = 0.9 * B  # the median reading; the workers' count as it
    np.testing.assert_allclose(got, rated_split(two, [full, full, 0.8 * B, 0.0], 2).fractions, atol=1e-12)
    assert got[2] > 0.4 and got[3] == 0


def test_slower_cpu_machines_that_save_little_are_left_out():
    from jbps.partition.rated_split import MIN_GAIN, rated_split, worthwhile_split
    from jbps.partition.split import optimal_split

    B, M = 125e6, 32 << 20
    roles = ["colocated"] * 4 + ["dedicated"] * 2
    # One CPU machine at 200 of 1,000 Mbit/s beside one at full rate saves 2% in the
    # formula: it is left out, and the split is k = 1's (split.py's formula).
    split = worthwhile_split(roles, [B] * 5 + [0.2 * B], 4)
    np.testing.assert_allclose(split.fractions, server_fractions(roles[:5], 4) + [0.0], atol=1e-9)
    assert split.time_s(M) == pytest.approx(optimal_split(4, 1).time_s(M, B), rel=1e-9)
    # At 400 Mbit/s it saves 4%, more than MIN_GAIN: it is used, at its rate's share.
    rates = [B] * 5 + [0.4 * B]
    split = worthwhile_split(roles, rates, 4)
    assert split == rated_split(roles, rates, 4) and split.fractions[5] > 0
    assert split.time_s(M) < (1 - MIN_GAIN) * optimal_split(4, 1).time_s(M, B)
    # The slower machines count together: four at a quarter of the rate save 11%.
    four = ["colocated"] * 4 + ["dedicated"] * 4
    split = worthwhile_split(four, [B] * 4 + [0.25 * B] * 4, 4)
    assert min(split.fractions[4:]) > 0
    # With two workers a CPU machine saves nothing (each worker's NIC carries its whole
    # gradient anyway): a slower one is left out.
    two = ["colocated"] * 2 + ["dedicated"] * 2
    split = worthwhile_split(two, [B, B, B, 0.3 * B], 2)
    assert split.fractions[3] == 0 and split.time_s(M) == pytest.approx(M / B)
