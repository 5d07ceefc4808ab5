"""Steering a pending elastic job to its Cell's GPU type: by partition, typed GRES or node
features, with CPUs and host memory per GPU from the Cell.

Unit tests of the choice and of the Slurm updates it becomes (both versions' syntax);
then the lab: an elastic job submitted to the lab's mixed partition starts there on nodes
of the type the policy chose, steered by features on 22.05 and by typed GRES on 25.11.
"""

import time

import pytest

from conftest import wait_for
from estimator.contract import parse_plan_comment
from slurm_ext.cli_backend import update_pending_argv
from slurm_ext.config import ConfigError, resolve
from slurm_ext.daemon import Daemon
from slurm_ext.lab import MIXED_PARTITION
from slurm_ext.run import run_command
from slurm_ext.slurm_client import Gres, JobUpdate, SlurmNode, SubmitRequest
from slurm_ext.steering import Steer, per_gpu_resources, steer, steer_to_nodes, steering
from slurm_ext.store import Store

V22, V25 = (22, 5, 8), (25, 11, 7)


def _node(name, gtype, gpus, parts, cpus=32, mem_mb=256000):
    return SlurmNode(name, "idle", partitions=parts, features=(gtype,), gres=(Gres("gpu", gtype, gpus),),
                     cpus=cpus, real_memory_mb=mem_mb)


NODES = (_node("a1", "a100", 4, ("a100", "gpu")), _node("a2", "a100", 4, ("a100", "gpu"), cpus=16),
         _node("v1", "v100", 8, ("v100", "gpu"), mem_mb=128000), _node("h1", "h100", 8, ("gpu",)))
TYPE_PARTS = {"a100": "a100", "v100": "v100"}


def _steering(method="auto", version=V22):
    return steering(method, version, NODES, TYPE_PARTS, lambda n: n.gpu_type)


def test_auto_moves_a_job_of_a_type_partition_and_steers_one_in_a_mixed_partition():
    s22, s25 = _steering(version=V22), _steering(version=V25)
    assert steer(s22, "a100", "v100") == Steer("partition", "v100")
    assert steer(s25, "a100", "v100") == Steer("partition", "v100")
    # In the mixed partition: features on 22.05, typed GRES from 23.02.6 on; it stays there.
    assert steer(s22, "gpu", "v100") == Steer("features", None, features="v100")
    assert steer(s25, "gpu", "v100") == Steer("gres", None, gpu_type="v100")
    # A type with no partition of its own is reached in the mixed partition that has it.
    assert steer(s22, "a100", "h100") == Steer("features", "gpu", features="h100")
    assert steer(s25, "v100", "h100") == Steer("gres", "gpu", gpu_type="h100")
    assert _steering(version=(23, 2, 5)).typed_gres is False and _steering(version=(23, 2, 6)).typed_gres


def test_a_retyped_request_names_the_gres_type_the_nodes_carry():
    """A site's own GRES names (a100_sxm4_80gb, mapped to a100 through ``partitions``):
    ``Gres=gpu:a100:4`` matched no node, and the job never started."""
    nodes = (_node("a1", "a100_sxm4_80gb", 4, ("a100", "gpu")), _node("v1", "v100", 8, ("v100", "gpu")),
             _node("v2", "v100s", 8, ("v100", "gpu")))  # two names for one type
    s = steering("auto", V25, nodes, {"a100": "a100", "v100": "v100"},
                 lambda n: {"a100_sxm4_80gb": "a100", "v100s": "v100"}.get(n.gpu_type, n.gpu_type))
    assert steer(s, "gpu", "a100") == Steer("gres", None, gpu_type="a100_sxm4_80gb")
    assert steer(s, "gpu", "v100") == Steer("features", None, features="v100")  # which name? by feature
    untyped = (SlurmNode("u1", "idle", partitions=("gpu",), features=("a100",), gres=(Gres("gpu", None, 4),),
                         cpus=32, real_memory_mb=256000),) + nodes[1:2]
    s = steering("gres", V25, untyped, {}, lambda n: "a100" if n.name == "u1" else n.gpu_type)
    assert steer(s, "gpu", "a100") == Steer("features", None, features="a100")  # no type to name


def test_forced_methods_and_types_no_partition_has():
    assert steer(_steering("partition"), "gpu", "a100") == Steer("partition", "a100")
    assert steer(_steering("partition"), "gpu", "h100") is None  # no partition of its own
    # Forced typed GRES on 22.05, which refuses to retype a pending job: node features.
    assert steer(_steering("gres", V22), "a100", "v100") == Steer("features", "gpu", features="v100")
    assert steer(_steering("gres", V25), "a100", "v100") == Steer("gres", "gpu", gpu_type="v100")
    assert steer(_steering("features", V25), "gpu", "a100") == Steer("features", None, features="a100")
    assert steer(_steering(), "gpu", "l20") is None
    with pytest.raises(ValueError, match="unknown steering"):
        _steering("magic")
    with pytest.raises(ConfigError, match="steering"):
        resolve({"steering": "magic"}, {}, {})


def test_a_start_pinned_to_nodes_is_steered_to_a_partition_that_holds_them_all():
    nodes = NODES + (_node("b1", "a100", 8, ("a100-big",)), _node("b2", "a100", 8, ("a100-big", "gpu")))
    s = steering("auto", V22, nodes, TYPE_PARTS, lambda n: n.gpu_type)
    how = steer(s, "a100", "a100")
    assert steer_to_nodes(s, how, "a100", ("a1", "a2")) == how  # already there
    assert steer_to_nodes(s, how, "a100", ("b1", "b2")) == Steer("partition", "a100-big")
    assert steer_to_nodes(s, how, "a100", ("a1", "b2")) == Steer("partition", "gpu")
    assert steer_to_nodes(s, how, "a100", ("a1", "b1")) is None  # no partition has both: no pin
    inside = steer(s, "gpu", "h100")  # stays in the job's own partition, which has the node
    assert steer_to_nodes(s, inside, "gpu", ("h1",)) == inside
    # A job steered by features inside the mixed partition, pinned to nodes only a partition
    # of the type alone holds, moves there by partition: a feature left on it would pin
    # the type when a later round moves it by partition to another.
    by_features = steer(s, "gpu", "a100")
    assert by_features.features == "a100"
    assert steer_to_nodes(s, by_features, "gpu", ("b1",)) == Steer("partition", "a100-big")


def test_cpus_and_memory_per_gpu_are_the_nodes_share_raised_for_offload():
    s = _steering()
    # a100: the smaller node has 16 CPUs for 4 GPUs; 256 GB for 4 GPUs.
    assert per_gpu_resources(s, "a100", 4, None) == (4, 64000)
    assert per_gpu_resources(s, "v100", 8, None) == (4, 16000)
    # A plan that keeps 40 GB per GPU on the host gets it; never more than a node holds.
    assert per_gpu_resources(s, "v100", 2, 40.0) == (4, 40000)
    assert per_gpu_resources(s, "v100", 8, 40.0) == (4, 16000)
    assert per_gpu_resources(s, "l20", 1, None) == (None, None)


def test_updates_in_each_versions_syntax():
    update = JobUpdate(gpus_per_node=4, gpu_type="v100", features="", cpus_per_gpu=4, mem_per_gpu_mb=16000,
                       start_now=False)
    # CPUs and memory per node: Slurm's per-GPU fields do not survive a pending update on
    # 22.05, nor a change between two runs of a requeued job on 25.11.
    assert update_pending_argv(7, update) == [
        "scontrol", "update", "JobId=7", "Gres=gpu:v100:4", "Features=", "MinCPUsNode=16", "MinMemoryNode=64000"]
    feat = JobUpdate(gpus_per_node=2, features="a100", cpus_per_gpu=8, mem_per_gpu_mb=1000, start_now=False)
    assert update_pending_argv(7, feat) == [
        "scontrol", "update", "JobId=7", "Gres=gpu:2", "Features=a100", "MinCPUsNode=16", "MinMemoryNode=2000"]
    with pytest.raises(Exception, match="gpus_per_node"):
        update_pending_argv(7, JobUpdate(gpu_type="a100"))
    with pytest.raises(Exception, match="gpus_per_node"):
        update_pending_argv(7, JobUpdate(cpus_per_gpu=4, admin_comment="x"))
    with pytest.raises(Exception, match="features"):
        update_pending_argv(7, JobUpdate(features="a100;rm"))


TRAINER = """#!/bin/bash
#ELASTIC global_batch=64 iterations=100000
trap 'exit 86' USR1
while true; do sleep 0.2 & wait $!; done
"""


@pytest.mark.slurm
def test_a_job_in_the_mixed_partition_is_steered_to_its_cells_type(slurm_lab, slurm_client, tmp_path):
    version = slurm_client.slurm_version()
    cfg = resolve({"state_db": str(tmp_path / "state.db")}, {}, {})
    daemon = Daemon(cfg, slurm_client, Store(cfg.state_db), out=lambda line: None)
    jobs = [slurm_client.submit(SubmitRequest(script=TRAINER, comment=comment, partition=MIXED_PARTITION,
                                              output=str(tmp_path / "%j.out"), workdir=str(tmp_path)))
            for comment in ("elastic model=gpt-760m gpus=2", "elastic model=gpt-1.3b gpus=4")]
    time.sleep(0.5)
    daemon.round()

    def all_run():
        got = [slurm_client.job(j) for j in jobs]
        return got if all(j is not None and j.is_running for j in got) else None
    ran = wait_for("both elastic jobs to run", all_run, 30)
    for job in ran:
        cell_type = parse_plan_comment(job.admin_comment).cell_parts()[0]
        assert job.partition == MIXED_PARTITION  # never moved out of the mixed partition
        assert job.granted_gpu_type == cell_type
        assert all(n.startswith(cell_type + "-") for n in job.nodes)
        shown = run_command(["scontrol", "show", "job", str(job.job_id)], 20, env=slurm_lab.env()).stdout
        if version >= (23, 2, 6):
            assert f"TresPerNode=gres/gpu:{cell_type}:" in shown
        else:
            assert f"Features={cell_type} " in shown
        # Each GPU's share of the node's CPUs (the lab's nodes have 16 CPUs each).
        per_node = job.granted_gpus_per_node[0]
        node_gpus = next(n.gpus for n in slurm_client.nodes() if n.name == job.nodes[0])
        assert f"NumCPUs={per_node * (16 // node_gpus) * len(job.nodes)} " in shown
        assert "MinMemoryNode=" in shown and "MinMemoryNode=0 " not in shown
