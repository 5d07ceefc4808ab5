"""`slurm-ext simulate`: replay a job trace on a cluster under one or more policies.

Prints a Markdown table to stdout; ``--json``, ``--markdown`` and ``--plots`` also write
the report's JSON, the table and PNG plots. Progress goes to stderr.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import sys
import time
from collections import Counter
from pathlib import Path

import click

from estimator.cluster import load_cluster
from estimator.errors import SpecError
from policy.registry import policy_names
from slurm_ext.commands import check_writable

log = logging.getLogger(__name__)

MIN_ROUND_S = 1.0  # a round is a policy decision: sub-second ones only slow the replay down
MAX_ROUND_S = 86400.0


class _Progress:
    """A one-line progress bar on stderr (a line every 30 s when stderr is not a terminal)."""

    def __init__(self, label: str, stream=sys.stderr):
        self.label = label
        self.stream = stream
        self.tty = stream.isatty()
        self.t0 = self.last = time.monotonic()

    def __call__(self, done: int, total: int, now_s: float) -> None:
        t = time.monotonic()
        final = done >= total
        if not final and t - self.last < (0.5 if self.tty else 30.0):
            return
        self.last = t
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        line = (f"{self.label:>12} [{bar:<30}] {done}/{total} jobs, "
                f"t={now_s / 3600:.1f} h simulated, {t - self.t0:.0f} s")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _write(path: str, text: str) -> None:
    if path == "-":
        click.echo(text, nl=False)
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    except OSError as e:
        raise SpecError("output", path, f"cannot write: {e.strerror}") from None


def _measured_costs(paths: tuple[str, ...]):
    """Restart costs from the runners' reports, or the defaults when none is given."""
    from estimator.contract import RunnerReport
    from policy.simulator import RestartCosts

    if not paths:
        return RestartCosts()
    files = []
    for given in paths:  # a quoted glob is expanded here (a shell's would give several values)
        matched = sorted(glob.glob(given)) if glob.has_magic(given) else [given]
        if not matched:
            raise SpecError("restart_costs", given, "matches no file")
        files += matched
    reports = []
    for path in files:
        try:
            report = RunnerReport.from_text(Path(path).read_text(errors="replace"))
        except OSError as e:
            raise SpecError("restart_costs", path, f"cannot read: {e.strerror}") from None
        if report is None or (report.startup_s is None and report.final_save_s is None
                              and not report.candidates_measured):
            raise SpecError("restart_costs", path, "not a runner's measured.json (a JSON object with "
                            "startup_s, final_save_s or tuning_s and candidates_measured)")
        negative = [k for k in ("startup_s", "final_save_s", "tuning_s") if (getattr(report, k) or 0.0) < 0]
        if negative:
            raise SpecError("restart_costs", path, f"{negative[0]}={getattr(report, negative[0])}: a time is "
                                                   "never negative (not a runner's report?)")
        reports.append(report)
    costs = RestartCosts.from_reports(reports)
    log.info("restart costs from %d runner reports: launch %.1f s, resume %.1f s, tuning %.1f s",
             len(reports), costs.launch_s, costs.checkpoint_resume_s, costs.tuning_pruned_s)
    return costs


@click.command("simulate")
@click.option("--trace", "trace_path", required=True, help="Trace CSV (job_id,submit_time_s,duration_s,num_gpus,...).")
@click.option("--cluster", "cluster_name", required=True, help="Built-in cluster name or cluster YAML.")
@click.option("--policy", "policies", multiple=True, required=True,
              help=f"Policy, repeated to compare: {', '.join(policy_names())}.")
@click.option("--trace-kind", type=click.Choice(["itp", "philly", "helios", "pai"]),
              help="How durations become iterations: itp (Philly's mapping, records before 1,945,572 s "
                   "skipped), philly, helios (iterations kept in 2,000-10,000), pai (1,000-5,000). Default: from "
                   "the file name (itp*, *helios* or *venus*, pai*, else philly); the report says which.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the trace-to-job mapping.")
@click.option("--density", default=1.0, show_default=True, type=float, help="Share of trace records kept, (0, 1].")
@click.option("--oracle", is_flag=True, help="Policies see measured iteration times instead of estimates.")
@click.option("--round-s", default=300.0, show_default=True, type=float,
              help="Seconds between scheduling rounds (1 to 86400); gavel (360 s) and sia (60 s) keep the rounds of "
                   "their papers unless --rounds-for-all.")
@click.option("--rounds-for-all", is_flag=True, help="--round-s also sets the rounds of gavel and sia.")
@click.option("--measured", "measured_path", default=None, help="Measured iteration-time CSV (ground truth).")
@click.option("--measured-program", type=click.Choice(["alpa", "runner"]), default="alpa", show_default=True,
              help="The program the measured rates came from, whose memory the policies' estimates count: alpa "
                   "for the shipped table (the Crius/Arena artifact), runner for rates of this repository's "
                   "runner.")
@click.option("--json", "json_out", default=None, help="Write the JSON report here ('-' for stdout).")
@click.option("--markdown", "markdown_out", default=None, help="Also write the Markdown table here.")
@click.option("--plots", "plots_dir", default=None, help="Write PNG plots into this directory.")
@click.option("--plan-search", type=click.Choice(["equal", "own", "full", "pruned", "none"]), default="equal",
              show_default=True,
              help="Plan search charged on a new Cell: equal, the runtime's own (pruned, under its budget) for "
                   "every policy, which is what the runtime does whatever policy chose the Cell; own, each "
                   "policy's as the Crius paper charged them (full for the baselines, pruned for crius and "
                   "cells-ilp); or full, pruned or none for every policy.")
@click.option("--restart-costs", "restart_reports", multiple=True,
              help="A runner's measured.json; repeat, or give a quoted glob ('ROOT/*/measured.json'): restart costs "
                   "become the medians the runtime measured (start-up, resume and save, tuning) instead of "
                   "the defaults.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--forecast-every", "forecast_every", default=0, show_default=True, type=int,
              help="Forecast the start and end of every N-th job at its arrival (the policy run forward, "
                   "as the daemon does) and report the forecasts' error; 0: none.")
def command(trace_path, cluster_name, policies, trace_kind, seed, density, oracle, round_s, rounds_for_all,
            measured_path,
            measured_program,
            json_out, markdown_out, plots_dir, plan_search, restart_reports, quiet, forecast_every):
    """Replay a job trace on a cluster under one or more policies."""
    from policy.measured import load_measured
    from policy.registry import make_policy, policy_class
    from policy.report import markdown_table, report_json, summarize, write_plots
    from policy.simulator import EstimateCache, SimConfig, SimulationError, simulate, start_costs
    from policy.trace import TRACE_KINDS, map_trace, offered_load, read_trace, trace_kind_for

    if not math.isfinite(round_s) or round_s < MIN_ROUND_S:
        raise SpecError("round_s", round_s, f"give at least {MIN_ROUND_S:g} s (shorter rounds only make the "
                                            "replay take longer)")
    if round_s > MAX_ROUND_S:
        raise SpecError("round_s", round_s, f"give at most {MAX_ROUND_S:g} s (a day): a policy woken less often "
                                            "leaves jobs unfinished at the replay's end")
    if forecast_every < 0:
        raise SpecError("forecast_every", forecast_every, "give 0 (no forecasts) or a positive job count")
    names = list(dict.fromkeys(p.strip().lower() for p in policies))
    for name in names:
        policy_class(name)  # unknown names fail before any work, listing the valid ones
    check_writable("output", json_out)  # before the simulation, not after it
    check_writable("output", markdown_out)
    check_writable("output", plots_dir, directory=True)
    cluster = load_cluster(cluster_name)
    table = load_measured(measured_path)
    measured_types = {p.gpu_type for p in table.points if p.iter_time_s}
    if not measured_types & set(cluster.gpu_types):
        raise SpecError("cluster", cluster_name, f"none of its GPU types ({', '.join(cluster.gpu_types)}) has a "
                        f"measured rate in {table.source} (it has {', '.join(sorted(measured_types)) or 'none'}), "
                        "so no job could run; give --measured with rates of these types")
    kind_name = trace_kind or next(k for k, v in TRACE_KINDS.items() if v == trace_kind_for(trace_path))
    kind = TRACE_KINDS[kind_name]
    jobs = map_trace(read_trace(trace_path), table, seed, density, kind)
    if not jobs:
        skipped = f" (--trace-kind {kind_name} skips records submitted before {kind.min_submit_s:,.0f} s)" \
            if kind.min_submit_s else ""
        raise SpecError("trace", trace_path, f"no job left after the submit filter{skipped} and density; "
                        "raise --density, give another --trace-kind or use another trace")
    # The mapping draws the papers' types (a100, v100, a40, a10): on a cluster without some,
    # policies that keep a job to the type it asked for leave it waiting, and averages of
    # finished jobs alone then favour them.
    missing = Counter(j.spec.gpu_type for j in jobs if j.spec.gpu_type not in cluster.gpu_types)
    if missing:
        click.echo(f"slurm-ext: warning: {sum(missing.values())} of {len(jobs)} jobs ask for GPU types "
                   f"{cluster.name} lacks ({', '.join(f'{t}: {n}' for t, n in sorted(missing.items()))}); "
                   "compare policies by their unfinished jobs too", err=True)
    load = offered_load(jobs, cluster.total_gpus())
    config = SimConfig(round_s=round_s, oracle=oracle, forecast_every_jobs=forecast_every,
                       plan_search=plan_search, costs=_measured_costs(restart_reports))
    cache = EstimateCache(cluster, table, oracle, program=measured_program)
    results, per_policy = [], {}
    for name in names:
        bar = None if quiet else _Progress(name)
        try:
            policy = make_policy(name)
            if rounds_for_all and getattr(policy, "round_s", None):
                policy = make_policy(name, round_s=round_s)
            result = simulate(policy, jobs, cluster, table, config, cache, bar)
        except SimulationError as e:
            raise click.ClickException(str(e)) from None
        results.append(result)
        per_policy[name] = summarize(result, load) | {"costs": start_costs(policy, config)}
    report = report_json(Path(trace_path).name, cluster.name, seed, per_policy, trace_kind=kind_name, density=density,
                         oracle=oracle, offered_load=round(load, 4), round_s=round_s, rounds_for_all=rounds_for_all,
                         plan_search=plan_search)
    log.info("estimates took %.1f s", cache.estimate_seconds)
    table_md = markdown_table(report)
    if json_out != "-":
        click.echo(table_md, nl=False)
    if markdown_out:
        _write(markdown_out, table_md)
    if json_out:
        _write(json_out, json.dumps(report, indent=2, sort_keys=False) + "\n")
    if plots_dir:
        for path in write_plots(results, plots_dir):
            log.info("plot %s", path)
