"""Figures of a sweep (:mod:`planner.sweep`): throughput per GPU and the time and cost to train a
token budget against the cluster size, one line per combination of the other axes that vary; a
tp × pp heatmap of one point's fastest plan per cell.

Built on :class:`matplotlib.figure.Figure` with the Agg canvas, like :mod:`planner.plots`; each
function returns the figure, every value drawn is a value of the table it is given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vocab.errors import ShardplanError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: the axes besides the cluster size that name a sweep's lines, with how a legend shows them
LINE_AXES = (("accelerator", "{}"), ("global_batch", "batch {}"), ("seq_len", "seq {}"),
             ("memory_limit_gib", "limit {} GiB"), ("target", "{}"), ("space", "{} space"))


def _figure(size: tuple[float, float], panels: int = 1) -> tuple[Figure, list[Any]]:
    """A plan plot's headless figure (:func:`planner.plots_common.new_figure`) with ``panels`` axes
    side by side."""
    from planner.plots_common import new_figure

    fig = new_figure(size)
    return fig, [fig.add_subplot(1, panels, i + 1) for i in range(panels)]


def _fitted(fig: Figure, text: str, fontsize: float = 12.0) -> str:
    """``text`` in lines no wider than the figure (about 0.6 of the font size a character): a title
    that names a long model and its held axes wraps instead of running off the figure's edges."""
    per_line = max(int(fig.get_figwidth() * 72 / (0.6 * fontsize)) - 2, 20)
    return _wrap(text, per_line)


def _lines(df: Any) -> list[tuple[str, Any]]:
    """(legend label, rows sorted by GPUs) per combination of the varying axes other than GPUs;
    rows without a plan are left out."""
    ok = df[df["status"] == "ok"]
    varying = [(a, fmt) for a, fmt in LINE_AXES if df[a].astype(str).nunique() > 1]
    if not varying:
        return [("", ok.sort_values("gpus"))]
    out = []
    for key, rows in ok.groupby([a for a, _ in varying], sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        label = ", ".join(fmt.format("default" if v is None or v != v else v)
                          for (_, fmt), v in zip(varying, key, strict=True))
        out.append((label, rows.sort_values("gpus")))
    return out


def _gpu_axis(ax: Any, df: Any) -> None:
    gpus = sorted(set(int(g) for g in df["gpus"]))
    ax.set_xscale("log", base=2)
    ax.set_xticks(gpus, [f"{g:,}" for g in gpus])
    ax.minorticks_off()
    ax.set_xlabel("GPUs")
    if len(gpus) > 6:
        for t in ax.get_xticklabels():
            t.set_rotation(45)
            t.set_horizontalalignment("right")
    ax.grid(True, alpha=0.3)


def _model(df: Any) -> str:
    """The model and the axes the sweep holds at one value (the title's subject)."""
    name = str(df["model"].iloc[0]) if "model" in df and len(df) else "model"
    fixed = [fmt.format(df[a].iloc[0]) for a, fmt in LINE_AXES
             if a not in ("target", "memory_limit_gib") and df[a].astype(str).nunique() == 1]
    return ", ".join([name, *fixed])


def _si(x: float) -> str:
    """``15e12`` as ``15T``."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if x >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


def _targets(df: Any) -> str:
    return ", ".join(sorted({str(t) for t in df["target"]}))


def throughput_figure(df: Any, size: tuple[float, float] = (8.0, 4.8)) -> Figure:
    """Tokens per second per GPU against the cluster size, a line per combination of the other axes."""
    fig, (ax,) = _figure(size)
    lines = _lines(df)
    if not any(len(rows) for _, rows in lines):
        raise ShardplanError("no point of the sweep has a plan: nothing to draw")
    for label, rows in lines:
        ax.plot(rows["gpus"], rows["tokens_per_s_per_gpu"], marker="o", label=label or None)
    _gpu_axis(ax, df)
    ax.set_ylabel("tokens/s per GPU")
    ax.set_ylim(bottom=0)
    ax.set_title(_fitted(fig, f"{_model(df)}: throughput per GPU by cluster size (target {_targets(df)})"))
    if len(lines) > 1:
        ax.legend(fontsize="small", loc="best")
    return fig


def cost_figure(df: Any, size: tuple[float, float] = (11.0, 4.6)) -> Figure:
    """Days and cost to train the sweep's token budget against the cluster size (two panels)."""
    ok = df[df["status"] == "ok"]
    if not len(ok) or ok["train_days"].isna().all():
        raise ShardplanError("the sweep has no token budget: sweep with tokens (--tokens) to draw time and cost")
    fig, (ax_t, ax_c) = _figure(size, 2)
    lines = _lines(df)
    has_cost = not ok["cost"].isna().all()
    for label, rows in lines:
        ax_t.plot(rows["gpus"], rows["train_days"], marker="o", label=label or None)
        if has_cost:
            ax_c.plot(rows["gpus"], rows["cost"] / 1e6, marker="o", label=label or None)
        else:
            ax_c.plot(rows["gpus"], rows["gpu_hours"] / 1e6, marker="o", label=label or None)
    tokens = df.attrs.get("tokens")
    budget = f"{_si(tokens)} tokens" if tokens else "the token budget"
    for ax in (ax_t, ax_c):
        _gpu_axis(ax, df)
        ax.set_ylim(bottom=0)
    ax_t.set_yscale("linear")
    ax_t.set_ylabel("days to train")
    ax_t.set_title(f"time to train {budget}")
    rate = df.attrs.get("gpu_hour_cost")
    ax_c.set_ylabel("cost (million $)" if has_cost else "GPU-hours (millions)")
    ax_c.set_title(f"cost at ${rate:g} per GPU-hour" if has_cost and rate is not None else "GPU-hours")
    if len(lines) > 1:
        ax_t.legend(fontsize="small", loc="best")
    fig.suptitle(_fitted(fig, f"{_model(df)}: time and cost by cluster size (target {_targets(df)})"))
    return fig


def heatmap_figure(hm: Any, size: tuple[float, float] = (9.0, 5.6)) -> Figure:
    """The tp × pp cells of :func:`planner.sweep.mesh_heatmap`: colour by tokens/s per GPU, each
    cell with its step time and the rest of its mesh; cells without a plan say why."""
    import numpy as np

    tps = sorted(set(int(t) for t in hm["tp"]))
    pps = sorted(set(int(p) for p in hm["pp"]))
    grid = np.full((len(tps), len(pps)), np.nan)
    fig, (ax,) = _figure(size)
    best = hm["tokens_per_s_per_gpu"].max()
    for _, r in hm.iterrows():
        i, j = tps.index(int(r["tp"])), pps.index(int(r["pp"]))
        grid[i, j] = r["tokens_per_s_per_gpu"]
    im = ax.imshow(grid, cmap="viridis", aspect="auto", origin="lower")
    for _, r in hm.iterrows():
        i, j = tps.index(int(r["tp"])), pps.index(int(r["pp"]))
        if r["status"] == "ok":
            rest = " ".join(x for x in str(r["mesh"]).split() if not x.startswith(("tp=", "pp=")))
            text = f"{r['step_time_s']:.3g} s\n{_wrap(rest, 18)}"
            star = r["tokens_per_s_per_gpu"] == best
            color = "black" if im.norm(r["tokens_per_s_per_gpu"]) > 0.5 else "white"  # on viridis' light half
            ax.text(j, i, ("★ " if star else "") + text, ha="center", va="center", fontsize=7, color=color)
        else:
            ax.text(j, i, _why(str(r["status"])), ha="center", va="center", fontsize=7, color="0.35")
    ax.set_xticks(range(len(pps)), [str(p) for p in pps])
    ax.set_yticks(range(len(tps)), [str(t) for t in tps])
    ax.set_xlabel("pipeline-parallel degree (pp)")
    ax.set_ylabel("tensor-parallel degree (tp)")
    fig.colorbar(im, ax=ax, label="tokens/s per GPU")
    a = hm.attrs
    ax.set_title(_fitted(fig, f"{a.get('model', 'model')} on {a.get('gpus', '?')}x {a.get('accelerator', '?')}, seq "
                              f"{a.get('seq_len', '?')}, batch {a.get('global_batch', '?')}: fastest plan per tp × pp "
                              f"(target {a.get('target', '?')})", 10), fontsize=10)
    return fig


def _wrap(text: str, width: int) -> str:
    """Words of ``text`` on lines of at most ``width`` characters."""
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return "\n".join(lines)


def _why(status: str) -> str:
    """A cell's reason, short enough for the cell."""
    low = status.lower()
    if "no valid" in low or "no mesh" in low or ("configuration" in low and "no" in low):
        return "no such mesh"
    if "memory" in low or "fit" in low:
        return "does not fit"
    return _wrap(status[:40], 18)
