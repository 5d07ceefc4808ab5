"""Which nodes the daemon can hand out: a GPU node in no partition runs no job, and a
cluster whose GPU types the daemon cannot name says so in one line."""

import logging

import pytest

from estimator.errors import SpecError
from policy.clock import SimulatedClock
from slurm_ext.config import resolve
from slurm_ext.daemon import Daemon
from slurm_ext.observe import cluster_spec, partition_types
from slurm_ext.slurm_client import Gres, SlurmJob, SlurmNode
from slurm_ext.store import Store
from test_daemon import TRAINER
from test_daemon_rounds import FakeSlurm

NOW = 1_800_000_000


def _gpu_node(name, gtype, gpus, partitions, used=0):
    return SlurmNode(name, "allocated" if used else "idle", partitions=partitions, features=(gtype,),
                     gres=(Gres("gpu", gtype, gpus),), gres_used=(Gres("gpu", gtype, used),) if used else (),
                     cpus=64, real_memory_mb=512000)


def _held(job_id, partition):
    return SlurmJob(job_id, "alice", "t", "PENDING", reason="JobHeldAdmin", partition=partition, priority=0,
                    comment="elastic model=gpt-760m gpus=4 global_batch=64 iterations=1000",
                    admin_comment="requested=any", gpus_per_node=4, node_count=1, submit_time_s=NOW - 60)


class _Slurm2205(FakeSlurm):
    def slurm_version(self):
        return (22, 5, 8)


def test_a_gpu_node_in_no_partition_is_not_offered_to_the_policy(tmp_path):
    """Under the default steering: an idle H100 in no partition (defined in slurm.conf, not
    yet in a partition) would be chosen round after round and never reached."""
    nodes = [_gpu_node("a100-1", "a100", 4, ("a100",), used=4), _gpu_node("h100-1", "h100", 8, ())]
    client = _Slurm2205([_held(41, "a100")], nodes, TRAINER)
    cfg = resolve({"state_db": str(tmp_path / "s.db"), "forecast_every_s": 0}, {}, {})
    d = Daemon(cfg, client, Store(cfg.state_db), clock=SimulatedClock(float(NOW)), out=lambda line: None)
    seen = []
    decide = d.policy.decide
    d.policy.decide = lambda snapshot: seen.append(snapshot) or decide(snapshot)
    d.round()
    assert [n.name for n in seen[-1].nodes] == ["a100-1"]
    assert not any(c[0] == "release" for c in client.calls)  # it waits for the A100s


def test_gpu_types_the_estimator_cannot_name_are_one_clear_error():
    nodes = (_gpu_node("gpu-1", "a100_sxm4_80gb", 4, ("gpu",)),)
    with pytest.raises(SpecError) as e:
        cluster_spec(nodes, partition_types(nodes, {}), None, "infiniband")
    assert "a100_sxm4_80gb" in str(e.value) and "partitions:" in str(e.value) and "\n" not in str(e.value)
    # Named in the config, the same nodes make a cluster.
    assert cluster_spec(nodes, partition_types(nodes, {"gpu": "a100"}), None, "infiniband").gpu_types == ("a100",)


def test_a_round_on_unnamed_gpu_types_logs_what_to_set(tmp_path, caplog):
    nodes = [_gpu_node("gpu-1", "a100_sxm4_80gb", 4, ("gpu",))]
    client = FakeSlurm([_held(41, "gpu")], nodes, TRAINER)
    cfg = resolve({"state_db": str(tmp_path / "s.db"), "forecast_every_s": 0}, {}, {})
    d = Daemon(cfg, client, Store(cfg.state_db), clock=SimulatedClock(float(NOW)), out=lambda line: None)
    with caplog.at_level(logging.ERROR):
        assert d.run(once=True) == 1
    assert any("round_failed" in r.getMessage() and "partitions:" in r.getMessage() for r in caplog.records)
