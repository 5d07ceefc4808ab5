"""Simulation results → the JSON of the `simulate` contract, a Markdown table and PNG plots.

Averages cover finished jobs only: unfinished and never-runnable jobs are counted and
listed, never padded into the averages. Every figure but the ``decision_time_*`` keys
(wall-clock measurements of the policy) is a function of the inputs and the seed.

Fragmentation (``fragmentation_avg``, ``fragmentation_p95``, ``fragmentation_avg_by_type``)
is the share of free GPUs that sit on partly used nodes (``policy.placement``), weighted
by how long the timeline holds each value: the average over time, and the value it stays
at or below for 95 % of the time, from the first decision to the last finish.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from policy.simulator import SimResult

log = logging.getLogger(__name__)

CONTRACT_KEYS = ("jobs", "finished", "unfinished", "avg_jct_s", "p50_jct_s", "p99_jct_s", "avg_queue_s",
                 "makespan_s", "avg_throughput", "restarts_per_job", "decision_time_p50_s",
                 "decision_time_p99_s", "decision_time_max_s")
TIMING_KEYS = ("decision_time_p50_s", "decision_time_p99_s", "decision_time_max_s")
MARKDOWN_COLUMNS = (
    ("finished", "finished", "{}"), ("unfinished", "unfinished", "{}"),
    ("avg_jct_s", "avg JCT (h)", "h"), ("p50_jct_s", "p50 JCT (h)", "h"), ("p99_jct_s", "p99 JCT (h)", "h"),
    ("avg_queue_s", "avg queue (h)", "h"), ("makespan_s", "makespan (h)", "h"),
    ("avg_throughput", "throughput (samples/s)", "{:.1f}"), ("restarts_per_job", "restarts/job", "{:.2f}"),
    ("fragmentation_avg", "fragmentation avg", "{:.3f}"), ("fragmentation_p95", "fragmentation p95", "{:.3f}"),
    ("decision_time_p50_s", "decide p50 (ms)", "ms"), ("decision_time_p99_s", "decide p99 (ms)", "ms"),
    ("decision_time_max_s", "decide max (ms)", "ms"),
)


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(float(x), digits)


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def time_weighted(times_s: list[float], values: list[float], end_s: float, q: float = 95.0
                  ) -> tuple[float | None, float | None]:
    """Average and q-th percentile of a step function over time.

    Args:
        times_s: when each value starts to hold (ascending).
        values: the value from that time until the next one.
        end_s: when the last value stops holding (earlier means the last holds for 0 s).
        q: the percentile: the smallest value the function stays at or below for at
            least q % of the time.

    Returns:
        (average, percentile), or (None, None) when the steps cover no time.
    """
    if not times_s:
        return None, None
    t = np.asarray(times_s, dtype=float)
    v = np.asarray(values, dtype=float)
    weights = np.diff(np.append(t, max(end_s, t[-1])))
    total = weights.sum()
    if total <= 0:
        return None, None
    order = np.argsort(v, kind="stable")
    covered = np.cumsum(weights[order])
    # The tolerance keeps a share that is exactly q % (up to rounding) on its own step.
    at = int(np.searchsorted(covered, q / 100.0 * total * (1 - 1e-12)))
    return float((v * weights).sum() / total), float(v[order][min(at, len(v) - 1)])


def _fragmentation_summary(result: SimResult) -> dict:
    timeline = result.timeline
    times = [p.time_s for p in timeline]
    avg, p95 = time_weighted(times, [p.fragmentation_frac for p in timeline], result.end_s)
    by_type = {t: _round(time_weighted(times, [p.fragmentation_frac_of(t) for p in timeline], result.end_s)[0], 4)
               for t in sorted(result.capacity_gpus)}
    return {"fragmentation_avg": _round(avg, 4), "fragmentation_p95": _round(p95, 4),
            "fragmentation_avg_by_type": by_type}


def summarize(result: SimResult, offered_load: float | None = None) -> dict:
    """The per-policy JSON object (contract keys first, then extras)."""
    jobs = result.jobs
    done = [o for o in jobs if o.status == "finished"]
    jct = [o.jct_s for o in done]
    queue = [o.queue_s for o in done]
    never = [o for o in jobs if o.status == "never_runnable"]
    left = [o for o in jobs if o.status == "unfinished"]
    makespan_s = result.end_s - result.start_s if done else None
    # Samples over the time they were processed in: up to the last finish, or to where the
    # replay stopped when jobs were left running (their samples so far count).
    run_end_s = result.end_s if not left or result.run_end_s is None else max(result.end_s, result.run_end_s)
    busy_s = run_end_s - result.start_s
    # Every job with a deadline counts: one left unfinished, dropped or never runnable
    # missed it (counting finished jobs alone would make a policy that drops jobs look perfect).
    with_deadline = [o for o in jobs if o.deadline_s is not None]
    times = list(result.decision_times_s)
    out = {
        "jobs": len(jobs),
        "finished": len(done),
        "unfinished": len(jobs) - len(done),
        "avg_jct_s": _round(sum(jct) / len(jct)) if jct else None,
        "p50_jct_s": _round(_pct(jct, 50)),
        "p99_jct_s": _round(_pct(jct, 99)),
        "avg_queue_s": _round(sum(queue) / len(queue)) if queue else None,
        "makespan_s": _round(makespan_s),
        "avg_throughput": _round(result.samples_done / busy_s) if busy_s > 0 else None,
        "restarts_per_job": _round(sum(o.restarts for o in jobs) / len(jobs)) if jobs else 0.0,
        "decision_time_p50_s": _round(_pct(times, 50), 6),
        "decision_time_p99_s": _round(_pct(times, 99), 6),
        "decision_time_max_s": _round(max(times), 6) if times else None,
        "decisions": len(times),
        "offered_load": _round(offered_load, 4),
        "never_runnable": [{"job_id": o.job_id, "model": o.spec.model, "global_batch": o.spec.global_batch,
                            "num_gpus": o.spec.num_gpus, "gpu_type": o.spec.gpu_type, "reason": o.reason}
                           for o in never],
        "left_unfinished": [{"job_id": o.job_id, "model": o.spec.model, "global_batch": o.spec.global_batch,
                             "num_gpus": o.spec.num_gpus, "gpu_type": o.spec.gpu_type,
                             "iterations_done": _round(o.iterations_done, 1), "iterations": o.iterations,
                             "reason": o.reason} for o in left],
        "samples_processed": _round(result.samples_done, 1),
        **_fragmentation_summary(result),
    }
    out.update(forecast_accuracy(jobs))
    if with_deadline:
        met = sum(o.status == "finished" and o.finish_s <= o.deadline_s for o in with_deadline)
        out["deadline_jobs"] = len(with_deadline)
        out["deadlines_met_frac"] = _round(met / len(with_deadline), 4)
        out["deadlines_missed_unfinished"] = sum(o.status != "finished" for o in with_deadline)
    return out


def forecast_accuracy(jobs) -> dict:
    """How far the forecasts made at arrival were from what happened (jobs that finished
    and had one): absolute errors of start and end in seconds, and relative to the job's
    wait (at least one minute) and JCT; median and p90 of each, and how many forecasts came
    from the list schedule beyond the forward run's decisions. Empty without forecasts."""
    rows = [o for o in jobs if o.status == "finished" and o.forecast_start_s is not None]
    if not rows:
        return {}
    start_err = [abs(o.forecast_start_s - o.first_start_s) for o in rows]
    start_rel = [e / max(60.0, o.first_start_s - o.submit_time_s) for e, o in zip(start_err, rows)]
    ends = [o for o in rows if o.forecast_end_s is not None]
    end_err = [abs(o.forecast_end_s - o.finish_s) for o in ends]
    end_rel = [e / o.jct_s for e, o in zip(end_err, ends)]

    def p50_p90(xs, digits=1):
        return {"p50": _round(_pct(xs, 50), digits), "p90": _round(_pct(xs, 90), digits)} if xs else None
    return {"forecast_jobs": len(rows), "forecast_with_end": len(ends),
            "forecast_extrapolated": sum(o.forecast_extrapolated for o in rows),
            "forecast_start_abs_err_s": p50_p90(start_err), "forecast_end_abs_err_s": p50_p90(end_err),
            "forecast_start_err_per_wait": p50_p90(start_rel, 3), "forecast_end_err_per_jct": p50_p90(end_rel, 3)}


def report_json(trace: str, cluster: str, seed: int, per_policy: dict[str, dict], **extra) -> dict:
    """The top-level object: ``{"trace", "cluster", "seed", "policies": {NAME: {...}}}`` plus extras."""
    return {"trace": trace, "cluster": cluster, "seed": seed, **extra, "policies": per_policy}


def _cell(value, fmt: str) -> str:
    if value is None:
        return "–"
    if fmt == "h":
        return f"{value / 3600:.2f}"
    if fmt == "ms":
        return f"{value * 1000:.2f}"
    return fmt.format(value)


def markdown_table(report: dict) -> str:
    """One row per policy with the contract figures (hours and milliseconds for reading)."""
    head = "| policy | jobs | " + " | ".join(title for _, title, _ in MARKDOWN_COLUMNS) + " |"
    rule = "|" + "---|" * (len(MARKDOWN_COLUMNS) + 2)
    rows = [head, rule]
    for name, s in report["policies"].items():
        rows.append(f"| {name} | {s['jobs']} | " + " | ".join(_cell(s.get(k), f) for k, _, f in MARKDOWN_COLUMNS) + " |")
    load = report.get("offered_load")
    kind = f" ({report['trace_kind']} mapping)" if report.get("trace_kind") else ""
    note = f"\nTrace {report['trace']}{kind} on {report['cluster']}, seed {report['seed']}"
    if load is not None:
        note += f", offered load {load:.3f} (GPU-hours asked ÷ GPU-hours offered while jobs arrive)"
    return "\n".join(rows) + note + ".\n"


def write_plots(results: list[SimResult], out_dir: str | Path) -> list[Path]:
    """JCT CDF, cluster throughput, queue length, fragmentation and GPU use per type over time, as PNGs.

    Returns:
        The files written.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        jct_h = np.sort([o.jct_s / 3600 for o in r.jobs if o.jct_s is not None])
        if len(jct_h):
            ax.step(jct_h, np.arange(1, len(jct_h) + 1) / len(r.jobs), where="post", label=r.policy)
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (h)")
    ax.set_ylabel("fraction of all jobs finished")
    ax.set_title("JCT CDF (unfinished jobs never reach the top)")
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(_save(fig, out / "jct_cdf.png", plt))

    for key, ylabel, fname in (("samples_per_s", "cluster throughput (samples/s)", "throughput.png"),
                               ("queued_jobs", "queued jobs", "queue_length.png"),
                               ("fragmentation_frac", "free GPUs on partly used nodes ÷ free GPUs",
                                "fragmentation.png")):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for r in results:
            xs = [(p.time_s - r.start_s) / 3600 for p in r.timeline]
            ax.step(xs, [getattr(p, key) for p in r.timeline], where="post", label=r.policy, linewidth=0.8)
        ax.set_xlabel("time since first arrival (h)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        written.append(_save(fig, out / fname, plt))

    fig, axes = plt.subplots(len(results), 1, figsize=(8, 2.6 * max(1, len(results))), squeeze=False, sharex=True)
    for ax, r in zip(axes[:, 0], results):
        xs = [(p.time_s - r.start_s) / 3600 for p in r.timeline]
        for gtype, cap in sorted(r.capacity_gpus.items()):
            ys = [dict(p.gpus_in_use).get(gtype, 0) / cap for p in r.timeline]
            ax.step(xs, ys, where="post", label=gtype, linewidth=0.8)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("share in use")
        ax.set_title(r.policy, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time since first arrival (h)")
    written.append(_save(fig, out / "gpu_use.png", plt))
    return written


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log.info("wrote %s", path)
    return path
