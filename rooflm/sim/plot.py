"""PNG charts of one simulated run: bench serve's latency and throughput charts (perf/plot.py),
and beside them the KV pool's usage and the queues over time, per replica."""

from __future__ import annotations

import os

from rooflm.sim.metrics import bench_outputs
from rooflm.sim.simulator import SimResult


def rate_path(path: str, rate: float) -> str:
    """One rate's file of a sweep: sim.png at 16 req/s -> sim-rate16.png."""
    stem, ext = os.path.splitext(path)
    return f"{stem}-rate{rate:g}{ext or '.png'}"


def plot_simulation(result: SimResult, metrics: dict, path: str, title: str = "") -> list[str]:
    """Two files, returned: `path` (latency distributions, throughput over time, as
    `bench serve --plot`) and `path` with -kv before the extension (KV usage, running and
    waiting requests)."""
    from rooflm.perf.serving_metrics import tpot_s
    from rooflm.perf.plot import _pyplot, plot_serving

    ok = [o for o in bench_outputs(result) if o.success]
    tpots = [t * 1e3 for t in (tpot_s(o) for o in ok) if t is not None]
    token_times = [t for o in ok for t in o.chunk_times]
    plot_serving([o.ttft * 1e3 for o in ok], tpots, [g * 1e3 for o in ok for g in o.itl],
                 [o.latency * 1e3 for o in ok], token_times, result.duration_s, path, title=title)

    plt = _pyplot()
    fig, (ax_kv, ax_q) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for replica in result.replicas[:8]:  # more lines than that say nothing more
        times = [s.start_s for s in replica.steps]
        ax_kv.plot(times, [100 * s.kv_usage for s in replica.steps], lw=0.8, label=f"replica {replica.index}")
        ax_q.plot(times, [s.num_running for s in replica.steps], lw=0.8, label=f"running {replica.index}")
        ax_q.plot(times, [s.num_waiting for s in replica.steps], lw=0.8, ls="--",
                  label=f"waiting {replica.index}")
    ax_kv.set_ylabel("KV blocks in use (%)")
    ax_kv.set_ylim(0, 100)
    ax_q.set_ylabel("requests")
    ax_q.set_xlabel("time (s)")
    ax_kv.legend(fontsize=7, loc="upper right")
    ax_q.legend(fontsize=7, loc="upper right", ncol=2)
    sim = metrics["sim"]
    fig.suptitle(f"{title}\n{sim['steps']} steps, {sim['preemptions']} preemptions", fontsize=10)
    fig.tight_layout()
    stem, ext = os.path.splitext(path)
    kv_path = f"{stem}-kv{ext or '.png'}"
    fig.savefig(kv_path, dpi=110)
    plt.close(fig)
    return [path, kv_path]
