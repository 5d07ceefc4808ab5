"""Profiling jobs: the batch script, and the daemon's background profiling.

Unit tests of the pure decisions (what to submit where, what to cancel, GPUs the policy
may use), then a lab test: with ``background_profiling`` on, the daemon profiles a known
model on an idle node at the lowest priority and cancels that job the moment an ordinary
job waits for the node's GPU type, which then runs.
"""

import shlex
import time

import pytest

from conftest import wait_for
from estimator.errors import SpecError
from slurm_ext.config import resolve
from slurm_ext.daemon import Daemon
from slurm_ext.profile_job import (
    BACKGROUND_COMMENT, JOB_NAME, LOWEST_NICE, BackgroundJob, BackgroundPlan, background_request,
    RETRY_AFTER_S, batch_script, free_for_policy, measure_budget_s, next_background, parse_background,
    partition_layout, retry_after_failures, to_cancel, waiting_partitions,
)
from slurm_ext.slurm_client import Gres, SlurmJob, SlurmNode, SubmitRequest
from slurm_ext.store import Store

PARTS = {"a10": "a10", "a100": "a100"}


def _node(name, part, gpus=2, used=0, state="idle"):
    return SlurmNode(name, state, (part,), (), (Gres("gpu", part, gpus),),
                     (Gres("gpu", part, used),) if used else ())


def test_batch_script_quotes_every_argument():
    argv = ["--model", "evil; rm -rf / #", "--profile-db", "/p q/db.sqlite"]
    script = batch_script("/venv/bin/python", argv, "pmi2")
    line = next(w for w in script.splitlines() if w.startswith("exec "))
    assert shlex.split(line)[1:] == ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--mpi=pmi2",
                                     "/venv/bin/python", "-m", "job_scripts.profile", *argv]
    assert "--mpi" not in batch_script("python", [], None)


def test_measure_budget_leaves_room_before_the_time_limit():
    assert measure_budget_s(30) == 1380 and measure_budget_s(30) < 30 * 60
    assert measure_budget_s(1) == 60  # a floor: a 1-minute job still measures something


def test_partition_layout_reads_type_and_node_size():
    nodes = [_node("a10-1", "a10"), _node("a10-2", "a10"), _node("a100-1", "a100", 4)]
    assert partition_layout(nodes, "a10", {}) == ("a10", 2, 2)
    assert partition_layout(nodes, "a100", {"a100": "h100"}) == ("h100", 4, 1)
    # A partition of two GPU types: Slurm could run the profile on either, filed under one.
    mixed = [SlurmNode(n.name, n.state, (*n.partitions, "gpu"), n.features, n.gres, n.gres_used) for n in nodes]
    with pytest.raises(SpecError, match="several types"):
        partition_layout(mixed, "gpu", {})
    with pytest.raises(Exception, match="no nodes"):
        partition_layout(nodes, "nope", {})


def test_background_job_round_trip_and_its_gpus_are_free_for_the_policy():
    plan = BackgroundPlan("a10-2", "a10", "a10", 2, "gpt-760m")
    req = background_request(plan, "python", "/db.sqlite", "pmi2", 10, "/logs/bg-%j.out")
    assert req.name == JOB_NAME and req.comment.startswith(BACKGROUND_COMMENT)
    assert f"--nice={LOWEST_NICE}" in req.extra_args and "--nodelist=a10-2" in req.extra_args
    assert (req.nodes, req.gres, req.time_limit_min, req.requeue) == (1, "gpu:2", 10, False)
    # the profiler stops measuring in time to fit and write before Slurm's limit
    argv = shlex.split(next(w for w in req.script.splitlines() if w.startswith("exec ")))
    assert argv[argv.index("--budget-s") + 1] == str(measure_budget_s(10)) == "420"
    job = SlurmJob(7, "root", JOB_NAME, "RUNNING", partition="a10", comment=req.comment,
                   nodes=("a10-2",), granted_gpus_per_node=(2,))
    bg = parse_background(job, PARTS)
    assert bg == BackgroundJob(7, "a10-2", "a10", "gpt-760m")
    assert parse_background(SlurmJob(8, "u", "train", "RUNNING", comment=req.comment), PARTS) is None
    nodes = (_node("a10-1", "a10", used=1), _node("a10-2", "a10", used=2))
    freed = free_for_policy(nodes, [bg], {7: job})
    assert [n.gpus_used for n in freed] == [1, 0]


def test_cancel_when_a_job_is_placed_on_the_node_or_waits_for_the_type():
    bg = [BackgroundJob(7, "a10-2", "a10", "m"), BackgroundJob(9, "a100-1", "a100", "m")]
    assert to_cancel(bg, {"a10-2"}, set()) == [bg[0]]
    assert to_cancel(bg, set(), {"a100"}) == [bg[1]]
    assert to_cancel(bg, {"a10-1"}, {"v100"}) == []


def test_a_job_waiting_in_a_partition_of_several_types_or_in_several_partitions_cancels_the_profile():
    """Only a job whose one partition had one GPU type counted: one pending in a mixed
    ``gpu`` partition, or in ``a100,v100``, waited for the profile's time limit."""
    bg = [BackgroundJob(9, "a100-1", "a100", "m")]
    node_parts = {"a100-1": ("a100", "gpu"), "v100-1": ("v100", "gpu")}
    for partition in ("gpu", "v100,a100"):
        waiting = waiting_partitions([SlurmJob(5, "u", "t", "PENDING", partition=partition, priority=1)])
        types = {PARTS[p] for p in waiting if p in PARTS}
        assert to_cancel(bg, set(), types, waiting, node_parts) == bg
    held = SlurmJob(6, "u", "t", "PENDING", partition="gpu", priority=0)
    assert waiting_partitions([held]) == set()
    assert to_cancel(bg, set(), set(), {"v100"}, node_parts) == []


def test_a_pair_that_fails_again_after_its_wait_waits_again():
    """The first failure's wait was kept (``setdefault``): once it had passed, a pair whose
    profile failed again was resubmitted every round."""
    def failed(job_id):
        return SlurmJob(job_id, "root", JOB_NAME, "FAILED", partition="a100", comment=f"{BACKGROUND_COMMENT} "
                        "model=gpt-760m", nodes=("a100-1",))
    pair = ("gpt-760m", "a100")
    retry = retry_after_failures([failed(101)], PARTS, {}, 100.0)
    assert retry == {pair: (101, 100.0 + RETRY_AFTER_S)}
    assert retry_after_failures([failed(101)], PARTS, retry, 200.0) == retry  # the same failure, seen again
    later = 100.0 + RETRY_AFTER_S + 50
    again = retry_after_failures([failed(101), failed(102)], PARTS, retry, later)
    assert again == {pair: (102, later + RETRY_AFTER_S)}
    assert retry_after_failures([failed(101), failed(102)], PARTS, again, later + 60) == again
    # One that completed without timing its model (its budget ran out first) waits too; one
    # that timed it does not.
    done = SlurmJob(103, "root", JOB_NAME, "COMPLETED", partition="a100",
                    comment=f"{BACKGROUND_COMMENT} model=gpt-760m", nodes=("a100-1",))
    assert retry_after_failures([done], PARTS, {}, 10.0, set()) == {pair: (103, 10.0 + RETRY_AFTER_S)}
    assert retry_after_failures([done], PARTS, {}, 10.0, {pair}) == {}


def test_next_background_picks_an_idle_node_of_an_unprofiled_pair():
    nodes = [_node("a10-1", "a10", used=1), _node("a10-2", "a10"), _node("a100-1", "a100", 4),
             _node("a100-2", "a100", 4, state="drained")]
    pick = next_background({"gpt-760m"}, set(), nodes, PARTS, set(), set(), {}, 0.0)
    assert pick == BackgroundPlan("a10-2", "a10", "a10", 2, "gpt-760m")
    # Profiled already on a10, the decision uses a10-2, or a job waits for a10: a100 next.
    for profiled, busy, waiting in (({("gpt-760m", "a10")}, set(), set()), (set(), {"a10-2"}, set()),
                                    (set(), set(), {"a10"})):
        pick = next_background({"gpt-760m"}, profiled, nodes, PARTS, busy, waiting, {}, 0.0)
        assert pick is not None and pick.node == "a100-1"
    # A pair whose profile failed waits; nothing idle, nothing to do.
    assert next_background({"gpt-760m"}, {("gpt-760m", "a100")}, nodes, PARTS, set(), set(),
                           {("gpt-760m", "a10"): 50.0}, 10.0) is None
    assert next_background({"gpt-760m"}, set(), nodes[:1], PARTS, set(), set(), {}, 0.0) is None
    # A node also in a partition a job waits in (a mixed one) is left to that job: a profile
    # there was cancelled the round after, and submitted again the round after that.
    mixed = [SlurmNode("a100-1", "idle", ("a100", "all"), (), (Gres("gpu", "a100", 4),), ())]
    assert next_background({"gpt-760m"}, set(), mixed, PARTS, set(), set(), {}, 0.0) is not None
    assert next_background({"gpt-760m"}, set(), mixed, PARTS, set(), set(), {}, 0.0, {"all"}) is None


TRAINER = """#!/bin/bash
#ELASTIC global_batch=64 iterations=5000
trap 'exit 86' USR1
while true; do sleep 0.2 & wait $!; done
"""


@pytest.mark.slurm
def test_the_daemon_profiles_an_idle_node_and_yields_it_to_a_user_job(slurm_lab, slurm_client, tmp_path):
    db = tmp_path / "profiles.sqlite"
    cfg = resolve({"state_db": str(tmp_path / "state.db"), "profile_db": str(db),
                   "background_profiling": True, "profile_mpi": "pmi2"}, {}, {})
    daemon = Daemon(cfg, slurm_client, Store(cfg.state_db), out=lambda line: None)
    elastic = slurm_client.submit(SubmitRequest(script=TRAINER, comment="elastic model=gpt-760m gpus=4",
                                                output=str(tmp_path / "%j.out"), workdir=str(tmp_path)))
    daemon.round()  # starts the elastic job, and a profiling job on an idle node

    def profiling():
        found = [j for j in slurm_client.jobs() if j.name == JOB_NAME and j.is_running]
        return found[0] if found else None
    prof = wait_for("a background profiling job to run", profiling, 30)
    assert prof.comment == f"{BACKGROUND_COMMENT} model=gpt-760m" and len(prof.nodes) == 1
    assert prof.job_id != elastic
    node = prof.nodes[0]
    part = prof.partition
    others = [n for n in slurm_client.nodes() if part in n.partitions]
    # A user's job needs every GPU of the partition: the next round cancels the profiling job.
    gpus = min(n.gpus for n in others)
    user = slurm_client.submit(SubmitRequest(script="#!/bin/bash\nsleep 60\n", name="user", partition=part,
                                             nodes=len(others), gres=f"gpu:{gpus}",
                                             output=str(tmp_path / "%j.out"), workdir=str(tmp_path)))
    time.sleep(1)
    daemon.round()

    def user_runs():
        j = slurm_client.job(user)
        return j if j is not None and j.is_running else None
    ran = wait_for("the user's job to run on the profiled node", user_runs, 30)
    assert node in ran.nodes
    assert slurm_client.job(prof.job_id).state == "CANCELLED"
    # While the user's job waits no longer, nothing is profiled on that partition again.
    daemon.round()
    assert not any(j.name == JOB_NAME and j.is_active and j.partition == part for j in slurm_client.jobs())
