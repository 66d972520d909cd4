"""How the lab's figures end: the legend beside the axes, never over the data,
and the y axis from 0 to a little above the highest point, so no marker or
line at the top is cut. Every plot function returns its figure (tests check
the layout), already saved."""

from __future__ import annotations


def finish(fig, ax, path: str, highest: float, *, dpi: int = 120, legend_fontsize="small"):
    """Saves `fig` to `path` with its legend outside `ax` and y from 0 to 12% above `highest`."""
    if highest > 0:
        ax.set_ylim(0, highest * 1.12)
    ax.legend(fontsize=legend_fontsize, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    return fig
