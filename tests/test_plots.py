"""The figures the benchmarks and `jbps plan` write, read as a reader would:
the legend beside the data, never over it, and every point inside the axes
(none cut at the top). Each plot function draws from a made-up report whose
highest point is a peer's (an axhline, which matplotlib's autoscale ignores)."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from benchmarks import __main__ as loopback  # noqa: E402
from benchmarks import network, overlap  # noqa: E402
from jbps.partition import __main__ as plan  # noqa: E402


def drawn(fig):
    """The renderer of `fig` drawn again (the plot functions close their figures)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def assert_readable(fig):
    renderer = drawn(fig)
    for ax in fig.axes:
        legend = ax.get_legend()
        assert legend is not None
        box, area = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
        assert not box.overlaps(area), f"the legend {box} lies over the axes {area}"
        top = ax.get_ylim()[1]
        for line in ax.get_lines():
            for y in line.get_ydata():
                if y != y:  # NaN: no point drawn
                    continue
                assert y <= top * 0.97, f"{line.get_label()}: a point at {y} is cut by the axes' top {top}"


def test_the_loopback_benchmarks_figure(tmp_path):
    sizes = [4 << 20, 64 << 20, 256 << 20]
    doc = {
        "config": {"sizes": sizes},
        "tools": {
            "jbps": {"tool": "jbps", "results": {s: {"median_s": s / 9e9} for s in sizes}},
            "mpi": {"tool": "MPI Allreduce", "results": {s: {"median_s": s / 10e9} for s in sizes}},
            "gloo": {"tool": "JAX gloo psum", "results": {s: {"median_s": s / 2e9} for s in sizes}},
        },
        "small_tensors": {"jbps": {"bytes": 14 << 20, "tree": {"median_s": 0.004}, "tool": "jbps", "leaves": 200}},
    }
    assert_readable(loopback.plot(doc, str(tmp_path / "loopback.png")))


def test_the_network_benchmarks_figure(tmp_path):
    doc = {
        "workers": 4,
        "rate_bits_per_s": 1e9,
        "bytes": 32 << 20,
        "variants": ["defaults"],
        "cases": [
            {"k": k, "formula_s": 0.4 - 0.03 * k, "jbps": {"defaults": {"median_s": 0.43 - 0.03 * k}}} for k in range(5)
        ],
        "peers": {"gloo": {"median_s": 0.44}, "mpi": {"median_s": 0.51}},  # above every jbps point
    }
    assert_readable(network.plot(doc, str(tmp_path / "network.png")))


def test_the_overlap_benchmarks_figure(tmp_path):
    rows = [
        {"call": f"bucket{i}", "pushes": [(i, i + 2.0)], "pulls": [(i + 3.0, i + 4.0)], "entered": i} for i in range(4)
    ]
    doc = {"rate_bits": 1e9, "cases": {"2": {"buckets": {"trace": [{"step_ms": 12.0}, *rows]}}}}
    fig = overlap.plot(doc, str(tmp_path / "overlap.png"))
    renderer = drawn(fig)
    legend, ax = fig.axes[0].get_legend(), fig.axes[0]
    assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))


@pytest.mark.parametrize("bandwidth", ["1", "100"])
def test_jbps_plans_figure(tmp_path, bandwidth, capsys):
    out = tmp_path / "plan.png"
    plan.main(["resnet50", "--workers", "4", "--cpu-servers", "0-4", "--bandwidth", bandwidth, "--plot", str(out)])
    capsys.readouterr()
    assert out.exists()
    report = plan.plan_rows("resnet50", 4, [0, 1, 2, 3, 4], float(bandwidth), None, 1)
    assert_readable(plan.plot(report, str(tmp_path / "again.png")))
