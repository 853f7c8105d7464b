"""PNG charts: the roofline of one step, and the latency and throughput of a serving benchmark.

matplotlib is imported inside the functions with the Agg backend, so importing
this module costs nothing and nothing ever needs a display.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from rooflm.perf.gpus import GpuSpec
from rooflm.perf.roofline import ATTENTION, COMM, MATMUL, VECTOR, OpRoofline


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_roofline(rows: Sequence[OpRoofline], gpu: GpuSpec, path: str, title: str = "",
                  compute_dtype: str = "bf16") -> None:
    """Log-log roofline: attainable TFLOP/s against FLOP/byte, every operation as a point.

    Each point sits at the operation's arithmetic intensity and the rate it
    would reach at its floor time (FLOPs / floor), i.e. on its own roof; ops that
    would overprint are one point with a merged label (group_points), and each
    point's area grows with its share of the step's floor time. Ops with no FLOPs
    (the embedding gather, TP all-reduces) have no place on a log axis and are
    listed in the legend title instead.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 6))

    plotted = [r for r in rows if r.op.flops > 0 and r.op.kind != COMM]
    intensities = [r.op.intensity for r in plotted]
    x_lo = 10 ** math.floor(math.log10(max(min(intensities, default=0.1), 1e-3))) / 10
    x_hi = 10 ** math.ceil(math.log10(max(max(intensities, default=1e4), gpu.ridge_point("bf16") * 10)))
    xs = [x_lo * (x_hi / x_lo) ** (i / 200) for i in range(201)]

    bw = gpu.mem_bw
    roofs = [(gpu.compute_roof_name(compute_dtype), gpu.peak_flops(compute_dtype), "tab:red")]
    if compute_dtype != "bf16" and not gpu.is_cpu:
        roofs.append(("bf16 (attention)", gpu.peak_flops("bf16"), "tab:orange"))
    roofs.append((f"{gpu.vector_roof_name} (element-wise)", gpu.peak_flops("fp32"), "tab:gray"))
    for label, peak, color in roofs:
        ax.plot(xs, [min(peak, bw * x) / 1e12 for x in xs], color=color,
                label=f"{label}: {peak / 1e12:,.0f} TFLOP/s, ridge {peak / bw:,.0f} FLOP/B")
        ax.axvline(peak / bw, color=color, linestyle=":", linewidth=0.8)

    roof_handles, _ = ax.get_legend_handles_labels()
    # Ops of one step often share a point (the weight matmuls of a decode step all sit at
    # ~1 FLOP/B on the same roof): those are drawn as one marker with a merged label, so
    # nothing overprints. The marker's area shows the group's share of the step's floor time.
    colors = plt.get_cmap("tab20").colors
    markers = "oDs^vP*Xhp<>"
    op_handles = []
    for i, group in enumerate(group_points(rows)):
        color = colors[i % len(colors)]
        op_handles.append(ax.scatter(
            [group.intensity], [group.tflops], marker=markers[i % len(markers)], color=color,
            s=marker_area(group.share), zorder=3, edgecolors="black", linewidths=0.4, alpha=0.85,
            label=f"{group.label}: {group.share:.0%} of the step ({group.intensity:.3g} FLOP/B, "
                  f"{group.bound})"))
        if group.share >= _LABELLED_SHARE:  # the rest are named in the legend only
            ax.annotate(f"{group.short_label} {group.share:.0%}", (group.intensity, group.tflops),
                        textcoords="offset points", xytext=(12, -12 * (i % 3)), fontsize=8)

    skipped = [r.op.name for r in rows if r not in plotted]
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte of device memory)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_title(title or f"roofline on {gpu.name}")
    ax.grid(True, which="both", linewidth=0.3)
    legend_title = f"{gpu.memory_name} {gpu.mem_bw_gbs:,.1f} GB/s ({gpu.source})"
    if skipped:
        legend_title += f"\nnot shown (no FLOPs): {', '.join(skipped)}"
    roof_legend = ax.legend(handles=roof_handles, loc="lower right", fontsize=8,
                            title=legend_title, title_fontsize=7)
    ax.add_artist(roof_legend)
    op_legend = ax.legend(handles=op_handles, loc="upper left", fontsize=7, title="operations",
                          title_fontsize=8)
    for handle in getattr(op_legend, "legend_handles", []):  # one size in the legend
        handle.set_sizes([40])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# Points closer than this in both log10 coordinates would overprint: they are one group.
_SAME_POINT_DECADES = 0.06
# Groups with at least this share of the step get a label beside their marker.
_LABELLED_SHARE = 0.02


@dataclass(frozen=True)
class PointGroup:
    """Operations drawn as one marker: their shared place on the roofline and their time."""

    names: tuple[str, ...]
    kinds: tuple[str, ...]
    intensity: float  # FLOP/B, of the group's total FLOPs over its total bytes
    tflops: float  # the rate at the group's floor time
    share: float  # the group's floor time over the whole step's floor time
    bound: str

    @property
    def label(self) -> str:
        if len(self.names) == 1:
            return self.names[0]
        return f"{self.short_label} ({', '.join(self.names)})"

    @property
    def short_label(self) -> str:
        if len(self.names) == 1:
            return self.names[0]
        kinds = set(self.kinds)
        noun = {MATMUL: "matmuls", ATTENTION: "attention ops", VECTOR: "element-wise ops"}
        return f"{len(self.names)} {noun[kinds.pop()] if len(kinds) == 1 else 'ops'}"


def group_points(rows: Sequence[OpRoofline]) -> list[PointGroup]:
    """The step's operations with FLOPs as roofline points, those that would overprint merged,
    largest share of the step's floor time first."""
    total_s = sum(r.floor_s for r in rows) or 1.0
    plotted = [r for r in rows if r.op.flops > 0 and r.op.kind != COMM]
    clusters: list[list[OpRoofline]] = []
    for r in sorted(plotted, key=lambda r: r.op.intensity):
        for cluster in clusters:
            head = cluster[0]
            if (abs(math.log10(r.op.intensity / head.op.intensity)) < _SAME_POINT_DECADES
                    and abs(math.log10(_rate(r) / _rate(head))) < _SAME_POINT_DECADES):
                cluster.append(r)
                break
        else:
            clusters.append([r])
    groups = []
    for cluster in clusters:
        flops = sum(r.op.flops for r in cluster)
        floor_s = sum(r.floor_s for r in cluster)
        bounds = {r.bound for r in cluster}
        groups.append(PointGroup(
            names=tuple(r.op.name for r in cluster), kinds=tuple(r.op.kind for r in cluster),
            intensity=flops / sum(r.op.bytes for r in cluster), tflops=flops / floor_s / 1e12,
            share=floor_s / total_s, bound=bounds.pop() if len(bounds) == 1 else "mixed"))
    return sorted(groups, key=lambda g: -g.share)


def _rate(r: OpRoofline) -> float:
    return r.op.flops / r.floor_s


def marker_area(share: float) -> float:
    """Scatter area (points^2) for a share of the step's time: area grows with the share,
    and a 1% op is still visible."""
    return 25.0 + 900.0 * share


def plot_serving(ttfts_ms: Sequence[float], tpots_ms: Sequence[float], itls_ms: Sequence[float],
                 e2els_ms: Sequence[float], token_times_s: Sequence[float], duration_s: float,
                 path: str, title: str = "") -> None:
    """Four panels: TTFT, TPOT and ITL distributions, and output tokens/s over time.

    token_times_s holds one entry per output token: the seconds since the
    benchmark started at which it arrived.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))

    def histogram(ax, values, label):
        if values:
            ax.hist(values, bins=min(50, max(5, len(values) // 2)), color="tab:blue", alpha=0.8)
            for q, style in ((50, "-"), (99, "--")):
                ax.axvline(_percentile(values, q), color="tab:red", linestyle=style,
                           label=f"P{q} {_percentile(values, q):.1f} ms")
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("count")
        ax.set_title(label)

    histogram(axes[0][0], list(ttfts_ms), "TTFT")
    histogram(axes[0][1], list(tpots_ms), "TPOT")
    histogram(axes[1][0], list(itls_ms), "ITL")

    ax = axes[1][1]
    # About 100 buckets over the run, none shorter than 0.1 s, so short and long runs
    # both show a curve rather than one bar or a comb of noise.
    width = max(0.1, duration_s / 100)
    buckets = max(1, math.ceil(duration_s / width))
    counts = [0] * buckets
    for t in token_times_s:
        counts[min(int(t / width), buckets - 1)] += 1
    edges = [i * width for i in range(buckets + 1)]
    rates = [c / width for c in counts]
    ax.stairs(rates, edges, color="tab:green", label=f"output tokens/s ({width:.2g} s buckets)")
    if e2els_ms:
        ax.set_title(f"throughput over time (median E2E latency {_percentile(e2els_ms, 50):.0f} ms)")
    else:
        ax.set_title("throughput over time")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("output tokens / s")
    ax.legend(fontsize=8)

    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_rate_sweep(rates: Sequence[float], sweep: Sequence[dict], path: str,
                    title: str = "") -> None:
    """Three panels against the request rate: TTFT and TPOT (P50 solid, P99 dashed), and
    goodput (or request throughput when no SLO was given) beside the offered rate.

    `sweep` holds one `rooflm bench serve` metrics dict per rate. An infinite rate
    (all at once) is drawn one step right of the largest finite rate and labelled
    "inf"; a figure that was not measured leaves a gap, not a zero.
    """
    plt = _pyplot()
    finite = sorted(r for r in rates if not math.isinf(r))
    inf_x = (finite[-1] * 2 if finite else 1.0)
    xs = [inf_x if math.isinf(r) else r for r in rates]
    order = sorted(range(len(rates)), key=lambda i: xs[i])
    xs = [xs[i] for i in order]
    sweep = [sweep[i] for i in order]
    labels = ["inf" if math.isinf(rates[i]) else f"{rates[i]:g}" for i in order]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))

    def percentiles(ax, key, name):
        for q, field, style in ((50, "median", "-"), (99, "p99", "--")):
            ys = [m[key][field] if m.get(key) else float("nan") for m in sweep]
            ax.plot(xs, ys, style, marker="o", label=f"P{q} {name}")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} against request rate")

    percentiles(axes[0], "ttft_ms", "TTFT")
    percentiles(axes[1], "tpot_ms", "TPOT")
    ax = axes[2]
    have_goodput = any(m.get("request_goodput") is not None for m in sweep)
    if have_goodput:
        ys = [m["request_goodput"] if m.get("request_goodput") is not None else float("nan")
              for m in sweep]
        ax.plot(xs, ys, marker="o", color="tab:green", label="goodput (req/s meeting SLOs)")
    ax.plot(xs, [m["request_throughput"] for m in sweep], marker="o", color="tab:blue",
            linestyle=":" if have_goodput else "-", label="completed req/s")
    ax.plot(xs, [x if not math.isinf(r) else float("nan") for x, r in
                 zip(xs, [rates[i] for i in order])], color="gray", linestyle="--",
            label="offered rate")
    ax.set_ylabel("requests / s")
    ax.set_title("goodput against request rate" if have_goodput
                 else "throughput against request rate (no --goodput SLOs)")
    for ax in axes:
        ax.set_xscale("log" if len(xs) > 1 and xs[0] > 0 and xs[-1] / xs[0] > 8 else "linear")
        ax.set_xticks(xs)
        ax.set_xticklabels(labels)
        ax.minorticks_off()
        ax.set_xlabel("request rate (req/s)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)

    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), without importing numpy here."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
