"""The daemon: configuration, the pure observe helpers, and rounds against the real lab
(its rounds over fixed jobs and nodes, without Slurm: tests/test_daemon_rounds.py).

Lab tests (marked ``slurm``) use the session lab of tests/conftest.py and skip without
Slurm or root.
"""

import json
import os
import sqlite3
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from types import SimpleNamespace

from estimator.cells import Cell
from estimator.plan_string import parse_plan
from conftest import wait_for as _wait
from slurm_ext.config import SLURM_ACCESS_KEYS, ConfigError, DaemonConfig, load_config, resolve
from policy.interface import Decision
from slurm_ext.act import HOLD_RESERVATION
from slurm_ext.daemon import (  # noqa: I001
    Daemon, build_snapshot, cluster_spec, model_loader_for, partition_types, requested_gpus,
    reserved_cell, running_assignment,
)
from dataclasses import replace

from slurm_ext.observe import finish_on_s, rescale_layover, rescale_releases, type_partitions
from policy.forecast import GpuRelease
from estimator.cells import CellEstimate
from slurm_ext.slurm_parse import parse_pending_listing
from slurm_ext.slurm_client import Gres, JobUpdate, SlurmJob, SlurmNode, SubmitRequest
from estimator.contract import MEASURED_FILE, RunnerReport, parse_plan_comment
from slurm_ext.squeue_view import rows
from slurm_ext.store import DONE, RESCALE, START, Store

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------- config


def test_config_precedence_flag_env_file_default():
    file_values = {"interval_s": 30, "policy": "fcfs", "poll_s": 5, "partitions": {"gpu": "A100"}}
    env = {"SLURM_EXT_INTERVAL_S": "20", "SLURM_EXT_POLICY": "gavel", "HOME": "/root"}
    cfg = resolve({"interval_s": 10.0, "dry_run": None}, env, file_values)
    assert cfg.interval_s == 10.0          # flag
    assert cfg.policy == "gavel"           # environment over file
    assert cfg.poll_s == 5.0               # file over default
    assert cfg.rescale_timeout_s == DaemonConfig().rescale_timeout_s  # default
    assert cfg.partition_map() == {"gpu": "a100"}
    assert cfg.dry_run is False
    assert DaemonConfig().policy == "cells-ilp"
    opts = resolve({}, {"SLURM_EXT_POLICY_OPTIONS": "{min_change_interval_s: 0, time_limit_s: 0.5}"}, {})
    assert dict(opts.policy_options) == {"min_change_interval_s": 0, "time_limit_s": 0.5}


def test_shipped_yaml_resolves_to_the_defaults():
    cfg = load_config(str(REPO / "etc" / "slurm-ext.yaml"), {}, {})
    assert cfg == DaemonConfig()


def test_a_command_that_only_reads_slurm_is_not_failed_by_other_settings(tmp_path):
    env = {"SLURM_EXT_CLUSTER": str(tmp_path / "missing.yaml"), "SLURM_EXT_INTERVAL_S": "soon",
           "SLURM_EXT_SLURM_PREFIX": "/opt/slurm-25.11", "SLURM_EXT_PARTITIONS": "gpu=a100"}
    with pytest.raises(ConfigError):
        load_config(None, {}, env)  # the daemon: every setting counts
    cfg = load_config(None, {}, env, only=SLURM_ACCESS_KEYS)
    assert (cfg.slurm_prefix, cfg.partition_map()) == ("/opt/slurm-25.11", {"gpu": "a100"})
    assert cfg.cluster == DaemonConfig().cluster and cfg.interval_s == DaemonConfig().interval_s
    with pytest.raises(ConfigError, match="slurm_backend"):  # one it uses is still checked
        load_config(None, {}, {**env, "SLURM_EXT_SLURM_BACKEND": "rest"}, only=SLURM_ACCESS_KEYS)


@pytest.mark.parametrize("file_values, env, field", [
    ({"intervall_s": 3}, {}, "intervall_s"),
    ({"interval_s": 0}, {}, "interval_s"),
    ({"interval_s": "soon"}, {}, "interval_s"),
    ({"metrics_port": 70000}, {}, "metrics_port"),
    ({"partitions": {"gpu": "tpu"}}, {}, "partitions.gpu"),
    ({"log_level": "LOUD"}, {}, "log_level"),
    ({}, {"SLURM_EXT_DRY_RUN": "perhaps"}, "dry_run"),
    ({}, {"SLURM_EXT_PARTITIONS": "a100"}, "partitions"),
    ({}, {"SLURM_EXT_POLICY_OPTIONS": "[1, 2]"}, "policy_options"),
    ({}, {"SLURM_EXT_POLICY_OPTIONS": "{a: "}, "policy_options"),
    ({"policy_options": {"no_such_option": 1}}, {}, "policy_options"),
    ({"policy_options": {"solvers": ["gurobi"]}}, {}, "policy_options"),
    # Options that would fail every round (a division by zero) fail here instead.
    ({"policy_options": {"wait_cost_s": 0}}, {}, "policy_options"),
    ({"policy_options": {"aging_s": 0}}, {}, "policy_options"),
    ({"policy_options": {"size_exponent": 1.5}}, {}, "policy_options"),
    ({"policy_options": {"share_limits": {"bob": 0}}}, {}, "policy_options"),
    ({"max_new_specs_per_round": 0}, {}, "max_new_specs_per_round"),
    # Values every round would trip over (a traceback, or every job run as submitted).
    ({"network": "infinband"}, {}, "network"),
    ({"cluster": "/nonexistent/cluster.yaml"}, {}, "cluster"),
    ({"micro_batches": 0}, {}, "micro_batches"),
    ({"max_gpus": 0}, {}, "max_gpus"),
    ({}, {"SLURM_EXT_INTERVAL_S": "inf"}, "interval_s"),
    ({"rescale_timeout_s": float("nan")}, {}, "rescale_timeout_s"),
    ({"rescale_timeout_s": 0}, {}, "rescale_timeout_s"),  # the requeue forced with no time to checkpoint
    ({"max_gpus": float("inf")}, {}, "max_gpus"),  # was an OverflowError traceback
    ({"metrics_port": float("inf")}, {}, "metrics_port"),
    ({"max_gpus": 2.7}, {}, "max_gpus"),  # not cut to 2 (the environment's "2.7" is refused too)
    ({"background_profile_time_min": 2}, {}, "background_profile_time_min"),  # no time left to measure
    # Options of the wrong type, which every round then failed on (a TypeError).
    ({"policy_options": {"max_pending": 2.5}}, {}, "policy_options.max_pending"),
    ({"policy": "gavel-greedy", "policy_options": {"max_moves": None}}, {}, "policy_options.max_moves"),
    ({"policy": "elasticflow", "policy_options": {"min_gain_frac": "10%"}}, {}, "policy_options.min_gain_frac"),
    ({"policy": "sia", "policy_options": {"fairness_p": "x"}}, {}, "policy_options.fairness_p"),
    ({"policy_options": {"deadlines": "yes"}}, {}, "policy_options.deadlines"),
])
def test_bad_config_names_key_and_source(file_values, env, field):
    with pytest.raises(ConfigError) as info:
        resolve({}, env, file_values, file_name="site.yaml")
    assert info.value.field == field
    assert ("site.yaml" in str(info.value)) or ("environment" in str(info.value))


@pytest.fixture
def daemon_command_process_state():
    """`slurm-ext daemon` sets up the process (root logging, signal handlers): put it back."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for s, h in signals.items():
        signal.signal(s, h)


@pytest.mark.parametrize("round_status", [0, 1])
@pytest.mark.usefixtures("daemon_command_process_state")
def test_daemon_once_exits_with_the_rounds_status(tmp_path, monkeypatch, round_status):
    """`slurm-ext daemon --once` says whether its round failed (a systemd unit or cron job
    reads the exit status); the round itself is replaced, so no Slurm is needed."""
    from slurm_ext.cli import main

    monkeypatch.setattr(Daemon, "run", lambda self, once=False: round_status)
    code = main(["daemon", "--once", "--dry-run", "--state-db", str(tmp_path / "state.db")])
    assert code == round_status


@pytest.mark.usefixtures("daemon_command_process_state")
def test_a_state_file_that_cannot_be_opened_is_one_error_line_and_status_1(tmp_path, capsys):
    from slurm_ext.cli import main

    (tmp_path / "file").write_text("")
    code = main(["daemon", "--once", "--state-db", str(tmp_path / "file" / "state.db")])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "\n" not in err
    assert err.startswith("slurm-ext: error: cannot open the state file") and "writable path" in err


# ------------------------------------------------------------------- pure helpers

def node(name, gtype, gpus, used=0, partition=None, state="idle"):
    return SlurmNode(name, state, partitions=(partition or gtype,), features=(gtype,),
                     gres=(Gres("gpu", gtype, gpus),),
                     gres_used=(Gres("gpu", gtype, used),) if used else ())


NODES = (node("a100-1", "a100", 4, used=4), node("a100-2", "a100", 4, used=2),
         node("v100-1", "v100", 4), node("h100-1", "h100", 8, state="down"),
         SlurmNode("cpu-1", "idle", partitions=("cpu",)))


def test_partition_types_derived_from_gres_and_config_wins():
    mixed = NODES + (node("x-1", "a10", 2, partition="a100"),)
    assert partition_types(mixed, {}) == {"v100": "v100", "h100": "h100"}
    assert partition_types(NODES, {"gpu": "a100"}) == {"gpu": "a100"}
    with_cpu_node = NODES + (SlurmNode("cpu-2", "idle", partitions=("v100",)),)
    assert partition_types(with_cpu_node, {})["v100"] == "v100"
    assert type_partitions({"big": "a100", "a100": "a100", "old": "v100"}) == {"a100": "a100", "v100": "old"}


def test_cluster_spec_from_nodes():
    spec = cluster_spec(NODES, partition_types(NODES, {}), None, "infiniband")
    groups = {g.gpu_type: (g.nodes, g.gpus_per_node, g.network.kind) for g in spec.node_groups}
    assert groups == {"a100": (2, 4, "infiniband"), "v100": (1, 4, "infiniband"), "h100": (1, 8, "infiniband")}


def test_max_stages_reaches_the_estimates_and_their_cache_key(tmp_path):
    from dataclasses import replace
    from slurm_ext.jobspec import ElasticSpec
    from slurm_ext.observe import estimate_key
    cfg = resolve({"state_db": str(tmp_path / "state.db")}, {}, {})
    daemon = Daemon(cfg, None, Store(cfg.state_db))  # _estimate makes no Slurm call
    cluster = cluster_spec(NODES, partition_types(NODES, {}), None, "infiniband")
    free = ElasticSpec("gpt-1.3b", 64, 10, num_gpus=4, gpu_type="a100")
    single = replace(free, max_stages=1)
    _, free_est = daemon._estimate(free, "root", cluster, 0.0)
    job, single_est = daemon._estimate(single, "root", cluster, 0.0)
    assert job.max_stages == 1
    assert any(e.cell.num_stages > 1 for e in free_est[cfg.plan_space])
    assert single_est[cfg.plan_space] and all(e.cell.num_stages == 1 for e in single_est[cfg.plan_space])

    def key(spec):
        return estimate_key(spec, cluster, cfg.plan_space, cfg.micro_batches, cfg.max_gpus)

    assert len({key(free), key(single), key(replace(free, max_stages=2))}) == 3
    assert len(json.loads(key(free))) == 8  # as before the key existed: stored estimates stay valid


def test_requested_gpus():
    assert requested_gpus(SlurmJob(1, "u", "n", "PENDING", gpus_per_node=4, node_count=2)) == 8
    assert requested_gpus(SlurmJob(1, "u", "n", "PENDING", gpus_per_job=6)) == 6
    assert requested_gpus(SlurmJob(1, "u", "n", "PENDING")) is None


def test_model_files_must_be_readable_by_the_job_owner(tmp_path):
    from estimator.errors import SpecError
    secret = tmp_path / "secret.yaml"
    secret.write_text("name: x\n")
    secret.chmod(0o600)  # owned by root, not world-readable
    with pytest.raises(SpecError, match="readable by the job's owner"):
        model_loader_for("nobody")(str(secret))
    with pytest.raises(SpecError, match="YAML file"):
        model_loader_for("nobody")("/dev/zero")
    with pytest.raises(SpecError, match="readable by the job's owner"):  # root's 0700 tmp_path: not even "missing"
        model_loader_for("nobody")(str(tmp_path / "missing.yaml"))
    assert model_loader_for("nobody")("gpt-760m").num_layers > 0


def test_pending_listing():
    text = "12|elastic model=x|\n13|plain|\n14_[1-3]|elastic|\n15||\n16|ELASTIC|\n"
    assert parse_pending_listing(text) == [12, 16]


def test_snapshot_counts_unmanaged_and_launching_gpus():
    part_types = partition_types(NODES, {})
    part_types["a100"] = "a100"
    running = SlurmJob(7, "u", "t", "RUNNING", partition="a100", comment="elastic",
                       admin_comment="cell=a100x4:s2 plan=[dp2tp1|dp2tp1]",
                       granted_gpus_per_node=(2, 2), granted_gpu_type="a100",
                       nodes=("a100-1", "a100-2"), node_count=2)
    node_types = {n.name: n.gpu_type for n in NODES}
    a = running_assignment(running, parse_plan_comment(running.admin_comment), node_types, part_types)
    assert a.cell == Cell("a100", 4, 2, 2)
    assert a.placement == (("a100-1", 2), ("a100-2", 2))

    # build_snapshot reads only the policy view of a managed job.
    managed = [SimpleNamespace(view=SimpleNamespace(assignment=a, submit_time_s=1.0, job_id="7"))]
    launching = SlurmJob(8, "u", "t", "PENDING", partition="v100", comment="elastic",
                         admin_comment="cell=v100x2:s1 why=x", gpus_per_node=2, node_count=1)
    as_submitted = SlurmJob(9, "u", "t", "PENDING", partition="v100", comment="elastic model=?",
                            admin_comment="error=model: missing", gpus_per_node=1, node_count=1)
    reserved = [reserved_cell(j, part_types) for j in (launching, as_submitted)]
    assert reserved == [Cell("v100", 2, 2, 1), Cell("v100", 1, 1, 1)]
    # The released job would finish at 900 s; when the one as submitted ends is not known.
    snap, releases = build_snapshot(100.0, NODES, managed, list(zip(reserved, (900.0, None), (None, None))), part_types,
                                    "round", 60.0, 30.0, None)
    unmanaged = {n.name: n.unmanaged_gpus for n in snap.nodes}
    # a100-1: 4 used, 2 of them by the managed job; a100-2: 2 used, all managed;
    # v100-1: 3 reserved for jobs about to start; h100-1 is down; cpu-1 has no GPUs.
    assert unmanaged == {"a100-1": 2, "a100-2": 0, "v100-1": 3, "h100-1": 8}
    assert (snap.now_s, snap.restart_cost_s, [n.name for n in snap.nodes if not n.usable]) == (100.0, 30.0, ["h100-1"])
    # A forecast frees the released job's two GPUs where they were reserved, when it ends.
    assert releases == (GpuRelease(900.0, "v100-1", 2),)


def _estimate(cell: Cell, iteration_time_s: float, feasible: bool = True) -> CellEstimate:
    return CellEstimate(cell, (), 4, iteration_time_s, 1.0, 10.0, feasible, "")


def test_finish_on_a_reserved_cell_uses_its_estimate_else_the_fastest_feasible_of_its_shape():
    estimates = (_estimate(Cell("v100", 4, 4, 1), 2.0), _estimate(Cell("v100", 4, 2, 1), 1.5),
                 _estimate(Cell("v100", 4, 4, 2), 0.5, feasible=False), _estimate(Cell("a100", 4, 4, 1), 0.2))
    # 100 iterations left at the Cell's own 2.0 s, from a start at 130 s (as a forecast runs it).
    assert finish_on_s(estimates, Cell("v100", 4, 4, 1), 100, 130.0) == 130.0 + 200.0
    # A layout never estimated (4 × 1): the fastest of its shape, 1.5 s (the 2 × 2 layout).
    assert finish_on_s(estimates, Cell("v100", 4, 1, 1), 100, 130.0) == 130.0 + 150.0
    assert finish_on_s(estimates, Cell("v100", 4, 4, 2), 100, 130.0) is None  # infeasible only
    assert finish_on_s(estimates, Cell("v100", 8, 4, 1), 100, 130.0) is None  # never estimated
    assert finish_on_s(estimates, Cell("a100", 4, 4, 1), -5, 130.0) == 130.0  # done already


def test_gpus_of_a_job_in_a_rescale_come_free_in_a_forecast():
    running = SlurmJob(7, "u", "t", "RUNNING", partition="a100", comment="elastic",
                       granted_gpus_per_node=(4, 2), nodes=("a100-1", "a100-2"), node_count=2)
    # Shrinking onto a100-1 (2 GPUs there): its 2 GPUs on a100-2 go now, the new Cell's 2 on
    # a100-1 when the job would finish on it; the 2 it holds beyond them on a100-1 go now too.
    assert rescale_releases(running, {"a100-1": 2}, 100.0, 5000.0) == (
        GpuRelease(100.0, "a100-1", 2), GpuRelease(100.0, "a100-2", 2), GpuRelease(5000.0, "a100-1", 2))
    # Growing to 4 on each: nothing goes now; all eight at its end (unknown: never).
    grow = {"a100-1": 4, "a100-2": 4}
    assert rescale_releases(running, grow, 100.0, 5000.0) == (
        GpuRelease(5000.0, "a100-1", 4), GpuRelease(5000.0, "a100-2", 4))
    assert rescale_releases(running, grow, 100.0, None) == ()
    # A suspension: all it holds goes now.
    assert rescale_releases(running, {}, 100.0, 5000.0) == (
        GpuRelease(100.0, "a100-1", 4), GpuRelease(100.0, "a100-2", 2))
    # Requeued already: it holds nothing.
    requeued = replace(running, state="PENDING", granted_gpus_per_node=(), nodes=())
    assert rescale_releases(requeued, grow, 100.0, 5000.0) == (
        GpuRelease(5000.0, "a100-1", 4), GpuRelease(5000.0, "a100-2", 4))


def test_a_rescale_on_nodes_slurm_picks_is_laid_over_the_gpus_its_run_leaves():
    held = {"a100-1": 4, "a100-2": 2, "v100-1": 4}
    types = {"a100-1": "a100", "a100-2": "a100", "a100-3": "a100", "v100-1": "v100"}
    # Six a100s, four per node: the node it holds most of, then the next.
    assert rescale_layover(Cell("a100", 6, 4, 1), held, types) == {"a100-1": 4, "a100-2": 2}
    # Two per node at most, three in all.
    assert rescale_layover(Cell("a100", 3, 2, 1), held, types) == {"a100-1": 2, "a100-2": 1}
    # Growing past what it holds: the rest is placed anew; another type: none laid over.
    assert rescale_layover(Cell("a100", 16, 4, 1), held, types) == {"a100-1": 4, "a100-2": 2}
    assert rescale_layover(Cell("h100", 8, 8, 1), held, types) == {}
    assert rescale_layover(None, held, types) == {}


def test_metrics_are_served_when_a_port_is_configured():
    pytest.importorskip("prometheus_client")
    import socket
    import urllib.request
    from slurm_ext.metrics import Metrics
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    metrics = Metrics(port)
    metrics.round_done(0.25, "ok")
    metrics.action("start")
    metrics.action("start")
    metrics.error("spec")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "slurm_ext_round_seconds_count 1.0" in text
    assert 'slurm_ext_actions_total{kind="start"} 2.0' in text
    assert 'slurm_ext_errors_total{kind="spec"} 1.0' in text
    off = Metrics(None)
    off.round_done(1.0, "ok")  # a no-op without a port
    assert not off.enabled


def test_a_metrics_port_in_use_disables_the_metrics_not_the_daemon(caplog):
    pytest.importorskip("prometheus_client")
    import socket
    from slurm_ext.metrics import Metrics
    with socket.socket() as sock:
        sock.bind(("", 0))
        sock.listen()
        with caplog.at_level("WARNING"):
            busy = Metrics(sock.getsockname()[1])
    assert not busy.enabled and "event=metrics_disabled reason=cannot_listen" in caplog.text
    busy.round_done(1.0, "ok")


# ------------------------------------------------------------------- the real lab

TRAINER = """#!/bin/bash
#ELASTIC global_batch=64 iterations=100000
trap 'exit 86' USR1
echo "trap set"
while true; do sleep 0.2 & wait $!; done
"""


def submit(client, tmp_path, comment=None, **kw):
    return client.submit(SubmitRequest(script=kw.pop("script", TRAINER), comment=comment,
                                       output=str(tmp_path / "%j.out"), workdir=str(tmp_path), **kw))


def wait_for(what, probe, timeout_s=25.0):
    return _wait(what, probe, timeout_s)


def trap_set(tmp_path, job_id):
    """A probe for a trainer that has installed its USR1 trap (Slurm shows a job running
    before its script starts: a signal sent earlier kills bash instead of requeueing it)."""
    def probe():
        out = tmp_path / f"{job_id}.out"
        return out.exists() and "trap set" in out.read_text()
    return probe


def running(client, *job_ids):
    def probe():
        jobs = {j.job_id: j for j in client.jobs()}
        got = [jobs.get(i) for i in job_ids]
        return got if all(j is not None and j.is_running for j in got) else None
    return probe


def running_after_requeue(client, job_id):
    """A probe for a job running again after a requeue (right after a rescale's signal it
    is still running its old allocation until it exits)."""
    def probe():
        got = running(client, job_id)()
        return got if got and got[0].restart_count >= 1 else None
    return probe


def rounds_until(daemon, probe):
    """A probe that runs a daemon round first (a rescale finishes over rounds)."""
    def run_then_probe():
        daemon.round()
        return probe()
    return run_then_probe


def make_daemon(lab, client, tmp_path, out=None, **config):
    cfg = resolve({"state_db": str(tmp_path / "state.db"), "rescale_timeout_s": 15.0, **config}, {}, {})
    store = Store(cfg.state_db)
    return Daemon(cfg, client, store, out=out or (lambda line: None))


def assert_runs_as_planned(job: SlurmJob):
    pc = parse_plan_comment(job.admin_comment)
    gtype, gpus, stages = pc.cell_parts()
    assert job.partition == gtype and job.granted_gpu_type == gtype
    assert job.granted_gpus == gpus
    stage_plans = pc.plan.strip("[]").split("|")
    assert len(stage_plans) == stages
    used = 0
    for sp in stage_plans:
        dp, tp = sp[2:].split("tp")
        used += int(dp) * int(tp)
    assert used == gpus
    assert pc.samples_per_s and pc.samples_per_s > 0 and pc.why
    # The runner inside the job reads the same plan back from the AdminComment.
    plan = parse_plan(" ".join(w for w in job.admin_comment.split()
                               if w.partition("=")[0] in ("cell", "plan", "mb", "remat", "layers")))
    assert (plan.gpu_type, plan.num_gpus, plan.num_stages) == (gtype, gpus, stages)


@pytest.mark.slurm
def test_elastic_jobs_start_on_the_chosen_cell_and_plain_jobs_are_untouched(slurm_lab, slurm_client, tmp_path):
    plain_running = submit(slurm_client, tmp_path, partition="h100", gres="gpu:h100:8", name="plain")
    plain_held = submit(slurm_client, tmp_path, partition="a10", gres="gpu:a10:1", hold=True, name="plain-held")
    wait_for("the plain job to run", running(slurm_client, plain_running))
    elastic = [
        submit(slurm_client, tmp_path, "elastic model=gpt-1.3b"),
        submit(slurm_client, tmp_path, "elastic model=moe-690m gpus=2 global_batch=32"),
        submit(slurm_client, tmp_path, "elastic model=gpt-2.6b", gres="gpu:a100:4", nodes=1),
    ]
    typed = slurm_client.job(elastic[2])
    assert typed.admin_comment == "requested=a100" and typed.gpu_type_requested is None
    before = {j.job_id: j for j in slurm_client.jobs()}
    daemon = make_daemon(slurm_lab, slurm_client, tmp_path)
    report = daemon.round()
    assert sorted(j for k, j in report.actions if k == "start") == sorted(elastic)
    jobs = wait_for("the elastic jobs to run", running(slurm_client, *elastic))
    for job in jobs:
        assert_runs_as_planned(job)
        assert job.partition != "h100", "the plain job's GPUs must count as used"
    assert parse_plan_comment(jobs[2].admin_comment).requested == "a100"
    after = {j.job_id: j for j in slurm_client.jobs()}
    for plain in (plain_running, plain_held):
        b, a = before[plain], after[plain]
        assert (a.partition, a.admin_comment, a.gpus_per_node, a.priority, a.state) == \
               (b.partition, b.admin_comment, b.gpus_per_node, b.priority, b.state)
    assert after[plain_held].is_held
    assert all(e.job_id not in (plain_running, plain_held) for e in daemon.store.entries())
    assert all(e.state == DONE for e in daemon.store.entries())
    # Each runs exactly where the policy placed it (the required node list).
    placed = {e.job_id: e.update.required_nodes for e in daemon.store.entries() if e.kind == START}
    assert all(placed[j] for j in elastic)
    assert {j.job_id: tuple(sorted(j.nodes)) for j in jobs} == {i: tuple(sorted(placed[i])) for i in elastic}
    # A second round with nothing new changes nothing.
    assert daemon.round().actions == ()


@pytest.mark.slurm
def test_a_guarantee_binds_only_within_the_admins_list_and_quota(slurm_lab, slurm_client, tmp_path):
    first = submit(slurm_client, tmp_path, "elastic model=gpt-760m gpus=2 guaranteed=yes")
    second = submit(slurm_client, tmp_path, "elastic model=gpt-760m gpus=2 guaranteed=yes")
    daemon = make_daemon(slurm_lab, slurm_client, tmp_path, guarantees={"users": {"root": 2}})
    daemon.round()
    ran = wait_for("both jobs to run", running(slurm_client, first, second))
    why = {j.job_id: parse_plan_comment(j.admin_comment).why for j in ran}
    assert "guarantee" not in why[first]
    assert "user root's guarantee quota is 2 GPUs and 2 are guaranteed to earlier jobs" in why[second]
    assert "best effort" in why[second]
    # The view every user reads shows it.
    (row,) = [r for r in rows(slurm_client.jobs()) if r.job_id == second]
    assert "guarantee refused" in row.why


class HoldingPolicy:
    """A policy that starts nothing and holds the nodes it is told to (cells-ilp's starvation
    bound emits such holds: test_cells_ilp.py); here what the daemon does with them."""

    name = "holding"

    def __init__(self, nodes):
        self.nodes = nodes

    def decide(self, snapshot):
        return Decision((), holds=(("x", self.nodes),) if self.nodes else ())


@pytest.mark.slurm
def test_a_plain_job_cannot_take_the_gpus_held_for_a_starving_job(slurm_lab, slurm_client, tmp_path):
    daemon = make_daemon(slurm_lab, slurm_client, tmp_path)
    daemon.policy = HoldingPolicy(("h100-1",))
    daemon.round()
    assert slurm_client.reserved_nodes(HOLD_RESERVATION) == ("h100-1",)
    plain = submit(slurm_client, tmp_path, partition="h100", gres="gpu:h100:2", name="plain")
    other = submit(slurm_client, tmp_path, partition="a10", gres="gpu:a10:1", name="elsewhere")
    wait_for("the job on other nodes to run", running(slurm_client, other))
    job = slurm_client.job(plain)
    assert job.is_pending and "reserved" in job.reason.lower(), job.reason
    # The hold moves with the policy's decision, and goes with it.
    daemon.policy = HoldingPolicy(("h100-1", "a100-2"))
    daemon.round()
    assert set(slurm_client.reserved_nodes(HOLD_RESERVATION)) == {"h100-1", "a100-2"}
    daemon.policy = HoldingPolicy(())
    daemon.round()
    assert slurm_client.reserved_nodes(HOLD_RESERVATION) is None
    wait_for("the plain job to run once nothing is held", running(slurm_client, plain))
    daemon.round()  # nothing held, nothing to remove: no call fails
    assert slurm_client.reserved_nodes(HOLD_RESERVATION) is None


@pytest.mark.slurm
def test_identical_starts_go_to_slurm_together_each_journaled(slurm_lab, slurm_client, tmp_path):
    ids = [submit(slurm_client, tmp_path, "elastic model=gpt-760m gpus=1") for _ in range(3)]
    daemon = make_daemon(slurm_lab, slurm_client, tmp_path)
    report = daemon.round()
    assert sorted(j for k, j in report.actions if k == "start") == sorted(ids)
    jobs = wait_for("the elastic jobs to run", running(slurm_client, *ids))
    # Same spec, same free GPUs: the same update, given with one scontrol call.
    assert len({(j.partition, j.admin_comment) for j in jobs}) == 1
    for job in jobs:
        assert_runs_as_planned(job)
    entries = daemon.store.entries()
    assert sorted(e.job_id for e in entries if e.kind == START) == sorted(ids)
    assert all(e.state == DONE for e in entries)


@pytest.mark.slurm
def test_bad_spec_runs_as_submitted_with_the_error_in_the_view(slurm_lab, slurm_client, tmp_path):
    bad = submit(slurm_client, tmp_path, "elastic model=no-such-model", partition="v100", gres="gpu:1")
    # Valid, but nothing in this cluster holds 15B parameters on 1 or 2 GPUs: never left held.
    too_big = submit(slurm_client, tmp_path, "elastic model=gpt-15b gpus=1", partition="a10", gres="gpu:1")
    daemon = make_daemon(slurm_lab, slurm_client, tmp_path)
    report = daemon.round()
    assert report.spec_errors == 2 and {("release", bad), ("release", too_big)} <= set(report.actions)
    job, big = wait_for("the bad-spec jobs to run as submitted", running(slurm_client, bad, too_big))
    assert job.partition == "v100" and job.granted_gpus == 1
    assert big.partition == "a10" and "no Cell of this cluster fits it" in big.admin_comment
    (row,) = [r for r in rows(slurm_client.jobs()) if r.job_id == bad]
    assert "no-such-model" in row.spec_error and "runs as submitted" in row.why
    assert row.cell is None
    assert daemon.round().actions == ()  # the error is written once
    # Any user sees it: the view reads only Slurm, not the daemon's state.
    as_nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    out = subprocess.run([*as_nobody, sys.executable, "-m", "slurm_ext", "squeue", "--json"],
                         env={**os.environ, **slurm_lab.env()}, capture_output=True, text=True,
                         timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    (seen,) = [j for j in json.loads(out.stdout)["jobs"] if j["job_id"] == bad]
    assert seen["elastic"] is True and "no-such-model" in seen["spec_error"]


@pytest.mark.slurm
def test_dry_run_changes_nothing(slurm_lab, slurm_client, tmp_path):
    ids = [submit(slurm_client, tmp_path, "elastic model=gpt-760m"),
           submit(slurm_client, tmp_path, "elastic model=nope")]
    before = {j.job_id: j for j in slurm_client.jobs()}
    printed = []
    daemon = make_daemon(slurm_lab, slurm_client, tmp_path, out=printed.append, dry_run=True)
    report = daemon.round()
    assert {j for _, j in report.actions} == set(ids)
    assert any(line.startswith(f"dry-run: start job={ids[0]}") for line in printed)
    assert any(line.startswith(f"dry-run: release job={ids[1]}") for line in printed)
    time.sleep(1.0)
    after = {j.job_id: j for j in slurm_client.jobs()}
    for i in ids:
        assert after[i].is_held and after[i].admin_comment == before[i].admin_comment
        assert after[i].partition == before[i].partition
    assert daemon.store.entries() == ()
    # Nor the state file: a dry run of other code beside the service rewrote its estimates.
    with sqlite3.connect(daemon.config.state_db) as conn:
        assert conn.execute("SELECT count(*) FROM estimates").fetchone() == (0,)


@pytest.mark.slurm
def test_restart_after_dying_between_journal_and_action(slurm_lab, slurm_client, tmp_path):
    """The daemon wrote its intent and died: before the update, and mid-rescale."""
    db = tmp_path / "state.db"
    store = Store(db)
    # 1. A held job whose start was journaled but never applied.
    pending = submit(slurm_client, tmp_path, "elastic model=gpt-760m")
    store.intend(pending, START, JobUpdate(partition="v100", gpus_per_node=2, num_nodes=1,
                                           admin_comment="cell=v100x2:s1 plan=[dp2tp1] why=recovered"), time.time())
    # 2. A running job signalled for a rescale: it requeues itself held, nobody releases it.
    moving = submit(slurm_client, tmp_path, "elastic model=gpt-760m", partition="a10", gres="gpu:1")
    slurm_client.release(moving)
    wait_for("the job to rescale to run", running(slurm_client, moving))
    wait_for("its USR1 trap", trap_set(tmp_path, moving))
    store.intend(moving, RESCALE, JobUpdate(partition="a100", gpus_per_node=4, num_nodes=1,
                                            admin_comment="cell=a100x4:s1 plan=[dp4tp1] why=recovered"), time.time())
    slurm_client.signal_batch(moving, "USR1")
    wait_for("the job to come back held", lambda: (j := slurm_client.job(moving)) and j.is_held and not j.is_running)
    store.close()  # the daemon is dead here

    daemon = make_daemon(slurm_lab, slurm_client, tmp_path)
    assert daemon.recover() == 2
    assert daemon.store.open_entries() == ()
    jobs = wait_for("both jobs to run again", running(slurm_client, pending, moving))
    assert (jobs[0].partition, jobs[0].granted_gpus) == ("v100", 2)
    assert (jobs[1].partition, jobs[1].granted_gpus, jobs[1].restart_count) == ("a100", 4, 1)
    assert not any(j.is_held for j in slurm_client.jobs() if j.is_active)


@pytest.mark.slurm
def test_running_job_is_rescaled_through_requeue(slurm_lab, slurm_client, tmp_path):
    blockers = [submit(slurm_client, tmp_path, partition=p, gres=g, nodes=n, name="blocker")
                for p, g, n in (("h100", "gpu:8", 1), ("a100", "gpu:4", 2), ("v100", "gpu:4", 2), ("a10", "gpu:2", 1))]
    wait_for("the blockers to run", running(slurm_client, *blockers))
    job = submit(slurm_client, tmp_path, "elastic model=gpt-760m gpus=2 iterations=100000000")
    # No minimum time between two changes of one job: the test's job changes seconds after it starts.
    daemon = make_daemon(slurm_lab, slurm_client, tmp_path, policy_options={"min_change_interval_s": 0})
    daemon.round()
    (first,) = wait_for("the elastic job to run", running(slurm_client, job))
    assert parse_plan_comment(first.admin_comment).cell_parts()[:2] == ("a10", 2)  # the stages are the policy's
    assert_runs_as_planned(first)
    wait_for("its USR1 trap", trap_set(tmp_path, job))
    slurm_client.cancel(blockers[-1])  # two a10 GPUs come free: the policy scales the job up
    wait_for("the a10 blocker to end", lambda: not (j := slurm_client.job(blockers[-1])) or not j.is_active)
    report = daemon.round()
    assert ("resize", job) in report.actions and report.rescaling == (job,)
    # The round signalled the job and returned; the next rounds finish the rescale.
    (after,) = wait_for("the rescaled job to run", rounds_until(daemon, running_after_requeue(slurm_client, job)))
    assert after.restart_count == 1 and after.granted_gpus == 4
    assert_runs_as_planned(after)
    assert daemon.store.open_entries() == ()


@pytest.mark.slurm
def test_running_job_shows_the_plan_its_runner_tuned(slurm_lab, slurm_client, tmp_path):
    job = submit(slurm_client, tmp_path, "elastic model=gpt-760m gpus=1")
    root = tmp_path / "checkpoints"
    daemon = make_daemon(slurm_lab, slurm_client, tmp_path, checkpoint_root=str(root),
                         use_cpu_measurements=True)
    daemon.round()
    (first,) = wait_for("the elastic job to run", running(slurm_client, job))
    pc = parse_plan_comment(first.admin_comment)
    # Another plan of the same Cell, as the runner reports it after tuning in the allocation.
    tuned = f"cell={pc.cell} plan={pc.plan} mb={pc.micro_batches * 2} remat={int(not pc.remat)}"
    (root / str(job)).mkdir(parents=True)
    (root / str(job) / MEASURED_FILE).write_text(json.dumps(RunnerReport(
        job_id=str(job), cell=pc.cell, plan=tuned, plan_source="tuned", iteration_time_s=5.12,
        samples_per_s=12.5, steps_measured=4, platform="cpu", global_batch=64, num_devices=1,
        restart_count=first.restart_count, step=None, step_at_s=None, updated_at_s=time.time(),
        tuning_s=3.0, candidates_measured=3).to_json()))
    report = daemon.round()
    assert report.plans_shown == (job,) and all(j != job for _, j in report.actions)
    after = slurm_client.job(job)
    assert after.is_running and (after.restart_count, after.start_time_s, after.nodes) == \
           (first.restart_count, first.start_time_s, first.nodes)
    shown = parse_plan_comment(after.admin_comment)
    assert (shown.cell, shown.plan, shown.micro_batches, shown.remat) == \
           (pc.cell, pc.plan, pc.micro_batches * 2, not pc.remat)
    assert (shown.plan_source, shown.samples_per_s, shown.sps_measured) == ("tuned", 12.5, True)
    assert (shown.requested, shown.why) == (pc.requested, pc.why)
    (row,) = [r for r in rows(slurm_client.jobs()) if r.job_id == job]
    assert (row.plan_source, row.measured_samples_per_s) == ("tuned", 12.5)
    again = daemon.round()
    assert again.plans_shown == () and all(j != job for _, j in again.actions)


SLOW_CHECKPOINT = """#!/bin/bash
#ELASTIC global_batch=64 iterations=100000000
trap 'sleep 6; exit 86' USR1
echo "trap set"
while true; do sleep 0.2 & wait $!; done
"""


@pytest.mark.slurm
def test_daemon_killed_mid_rescale_is_finished_on_restart(slurm_lab, slurm_client, tmp_path):
    """kill -9 while a job checkpoints for a rescale: the restarted daemon releases it."""
    blockers = [submit(slurm_client, tmp_path, partition=p, gres=g, nodes=n, name="blocker")
                for p, g, n in (("h100", "gpu:8", 1), ("a100", "gpu:4", 2), ("v100", "gpu:4", 2), ("a10", "gpu:2", 1))]
    wait_for("the blockers to run", running(slurm_client, *blockers))
    job = submit(slurm_client, tmp_path, "elastic model=gpt-760m gpus=2", script=SLOW_CHECKPOINT)
    db = tmp_path / "state.db"
    env = {**os.environ, **slurm_lab.env(), "SLURM_EXT_POLL_S": "0.5",
           "SLURM_EXT_POLICY_OPTIONS": "{min_change_interval_s: 0}"}
    argv = [sys.executable, "-m", "slurm_ext", "daemon", "--interval-s", "2", "--state-db", str(db)]
    log_path = tmp_path / "daemon.err"
    with open(log_path, "w") as err:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_for("the elastic job to run", running(slurm_client, job))
        wait_for("its USR1 trap", trap_set(tmp_path, job))
        slurm_client.cancel(blockers[-1])  # two a10 GPUs come free: the policy scales the job up
        wait_for("the rescale to be journaled", lambda: "rescale_signalled" in log_path.read_text(), 30)
    finally:
        proc.kill()  # SIGKILL: no chance to finish the rescale
        proc.wait(timeout=10)
    store = Store(db)
    (entry,) = [e for e in store.open_entries() if e.job_id == job]
    assert entry.kind == RESCALE
    store.close()
    held = wait_for("the job to come back held",
                    lambda: (j := slurm_client.job(job)) and j.is_held and not j.is_running and j)
    assert held.restart_count == 1
    out = subprocess.run(argv + ["--once"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "event=recover" in out.stderr
    (after,) = wait_for("the job to run on its new Cell", running(slurm_client, job))
    assert after.granted_gpus == entry.update.gpus_per_node * entry.update.num_nodes
    assert after.partition == entry.update.partition
    assert_runs_as_planned(after)
    assert not any(j.is_held for j in slurm_client.jobs() if j.is_active)


CHECKPOINT_40_S = SLOW_CHECKPOINT.replace("sleep 6;", "sleep 40;")


@pytest.mark.slurm
@pytest.mark.scenario
def test_a_new_job_starts_while_another_checkpoints_for_its_rescale(slurm_lab, slurm_client, tmp_path):
    """A rescale never holds up a round: while one job takes 40 s to checkpoint, a new
    elastic job that fits on free GPUs starts within 12 s of its submission."""
    blockers = {p: [submit(slurm_client, tmp_path, partition=p, gres=g, nodes=1, name="blocker")
                    for _ in range(n)]
                for p, g, n in (("h100", "gpu:8", 1), ("a100", "gpu:4", 2), ("v100", "gpu:4", 2), ("a10", "gpu:2", 1))}
    wait_for("the blockers to run", running(slurm_client, *[b for bs in blockers.values() for b in bs]))
    slow = submit(slurm_client, tmp_path, "elastic model=gpt-760m gpus=2", script=CHECKPOINT_40_S)
    env = {**os.environ, **slurm_lab.env(), "SLURM_EXT_POLL_S": "0.5",
           "SLURM_EXT_POLICY_OPTIONS": "{min_change_interval_s: 0}"}
    log_path = tmp_path / "daemon.err"
    argv = [sys.executable, "-m", "slurm_ext", "daemon", "--interval-s", "2", "--state-db",
            str(tmp_path / "state.db")]
    with open(log_path, "w") as err:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        (first,) = wait_for("the slow job to run", running(slurm_client, slow))
        wait_for("its USR1 trap", trap_set(tmp_path, slow))
        slurm_client.cancel(blockers["a10"][0])  # two a10 GPUs come free: the slow job scales up
        wait_for("its rescale to be signalled", lambda: "rescale_signalled" in log_path.read_text(), 30)
        slurm_client.cancel(blockers["v100"][0])  # a v100 node comes free
        wait_for("the v100 node to be free", lambda: not (j := slurm_client.job(blockers["v100"][0]))
                 or not j.is_active)
        submitted_s = time.monotonic()
        new = submit(slurm_client, tmp_path, "elastic model=gpt-760m gpus=4")
        (started,) = wait_for("the new job to start", running(slurm_client, new), 12)
        assert time.monotonic() - submitted_s <= 12
        assert started.partition == "v100"
        still = slurm_client.job(slow)
        assert still.is_running and still.restart_count == first.restart_count  # still checkpointing
        after = wait_for("the slow job to run on its new Cell", lambda: (j := slurm_client.job(slow))
                         and j.is_running and j.restart_count > first.restart_count and j, 90)
        assert after.restart_count == first.restart_count + 1 and (after.partition, after.granted_gpus) == ("a10", 4)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slurm
def test_daemon_survives_slurmctld_outage(slurm_lab, slurm_client, tmp_path):
    env = {**os.environ, **slurm_lab.env(), "SLURM_EXT_POLL_S": "0.5",
           "SLURM_EXT_SLURM_TIMEOUT_S": "5", "SLURM_EXT_BACKOFF_MAX_S": "4"}
    log_path = tmp_path / "daemon.err"
    with open(log_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "slurm_ext", "daemon", "--interval-s", "2",
                                 "--state-db", str(tmp_path / "state.db")],
                                env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_for("a first round", lambda: "round_done" in log_path.read_text())
        slurm_lab.stop_slurmctld()
        try:
            wait_for("the daemon to find Slurm unreachable",
                     lambda: "slurm_unreachable" in log_path.read_text(), 30)
            # It retries with back-off (at most 4 s apart). Each CLI attempt ends after
            # slurm_timeout_s; a pyslurm RPC after slurm.conf's MessageTimeout (10 s).
            wait_for("the daemon to try again", lambda: log_path.read_text().count("slurm_unreachable") >= 2, 30)
            assert proc.poll() is None, "the daemon must keep running while slurmctld is down"
        finally:  # the session's other tests need the controller back
            slurm_lab.start_slurmctld()
        job = submit(slurm_client, tmp_path, "elastic model=gpt-760m")
        (ran,) = wait_for("the daemon to start a new job on its own", running(slurm_client, job), 40)
        assert parse_plan_comment(ran.admin_comment).cell is not None
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=20)
    assert rc == 0
    assert "daemon_stopped" in log_path.read_text()



def test_measurement_feedback_only_for_the_current_cell():
    from slurm_ext.observe import measurement_from_text
    text = json.dumps({"cell": "a100x4:s1", "iteration_time_s": 2.0, "steps_measured": 8, "platform": "gpu"})
    m = measurement_from_text(text, "a100x4:s1", allow_cpu=False)
    assert m is not None and m.iteration_time_s == 2.0
    assert measurement_from_text(text, "a10x4:s1", allow_cpu=False) is None  # before a rescale
    cpu = text.replace('"gpu"', '"cpu"')
    assert measurement_from_text(cpu, "a100x4:s1", allow_cpu=False) is None
    assert measurement_from_text(cpu, "a100x4:s1", allow_cpu=True) is not None
    assert measurement_from_text("{not json", "a100x4:s1", allow_cpu=True) is None
