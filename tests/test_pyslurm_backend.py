"""The pyslurm backend's reading, offline: what pyslurm reported of a Slurm 25.11 lab becomes
the same jobs and nodes the CLI backend read at the same moment (recorded by
``tests/fixtures/record_pyslurm.py``). The live parity runs in the integration tests."""

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from slurm_ext.pyslurm_backend import PyslurmClient, gres_in_use, job_record, node_record
from slurm_ext.slurm_parse import parse_job, parse_node

RECORDED = json.loads((Path(__file__).parent / "fixtures" / "slurm-25.11" / "pyslurm.json").read_text())


class FakeJob(SimpleNamespace):
    """A pyslurm.Job as recorded: its attributes and its resource layout per node."""

    def __init__(self, recorded: dict):
        super().__init__(**recorded["attributes"])
        self._layout = recorded["layout"]

    def get_resource_layout_per_node(self):
        return self._layout


def plain(value) -> object:
    """A dataclass as the recording stored it (tuples as lists)."""
    return json.loads(json.dumps(dataclasses.asdict(value), default=str))


def test_every_job_reads_as_the_cli_read_it():
    jobs = [parse_job(job_record(FakeJob(r), r["tres_per_job"])) for r in RECORDED["jobs"]]
    assert [plain(j) for j in jobs] == RECORDED["cli_jobs"]
    by_name = {j.name: j for j in jobs}
    # The situations the recording set out to catch.
    assert by_name["elastic-gpus"].gpus_per_job == 6  # tres_per_job, which pyslurm cannot read
    two = by_name["running-2node"]
    assert two.granted_gpus_per_node == (1, 1) and two.granted_gpu_type == "v100"
    assert by_name["rescale"].exit_code == 86 and by_name["rescale"].is_held
    limited = [j for j in jobs if j.name == "a100-limited"]
    assert limited and all(j.end_time_s == 0 or j.end_time_s > j.start_time_s for j in limited)
    arrays = [j for j in jobs if j.name == "array-throttled"]
    assert any(j.array_task_spec.endswith("%2") for j in arrays)
    assert 0 in {j.array_task_id for j in arrays}  # pyslurm reads task 0 as unset


def test_every_node_reads_as_the_cli_read_it_with_gpus_in_use_from_the_jobs():
    used = gres_in_use(FakeJob(r) for r in RECORDED["jobs"])
    nodes = [parse_node(node_record(SimpleNamespace(**n), used.get(n["name"]))) for n in RECORDED["nodes"]]
    assert [plain(n) for n in nodes] == RECORDED["cli_nodes"]
    assert sum(n.gpus_used for n in nodes) > 0


def test_gpus_in_use_count_only_jobs_that_hold_resources():
    held = FakeJob({"attributes": {"state": "RUNNING"},
                    "layout": {"n1": {"gres": {"gpu:a100": {"count": 3, "indexes": "0-2"}}}}})
    gone = FakeJob({"attributes": {"state": "COMPLETED"},
                    "layout": {"n1": {"gres": {"gpu:a100": {"count": 4, "indexes": "0-3"}}}}})
    assert gres_in_use([held, gone]) == {"n1": {"gpu:a100": 3}}


def test_without_pyslurm_the_error_says_how_to_install_it(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_pyslurm(name, *args, **kwargs):
        if name == "pyslurm":
            raise ImportError("No module named 'pyslurm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyslurm)
    monkeypatch.delitem(__import__("sys").modules, "pyslurm", raising=False)
    with pytest.raises(Exception, match="pip install -e '.\\[pyslurm\\]'.*slurm_backend: cli"):
        PyslurmClient(env={})


def test_clearing_a_jobs_features_goes_through_scontrol_before_the_rest():
    """pyslurm sends an empty constraint as unset (Slurm: no change); a job retyped in a
    mixed partition would keep the old type's constraint and never start."""
    from slurm_ext.slurm_client import JobUpdate

    calls = []

    class Job:
        def __init__(self, job_id):
            self.job_id = job_id

        def modify(self, desc):
            calls.append(("modify", self.job_id, desc))

    client = object.__new__(PyslurmClient)  # no Slurm here: the two halves are recorded
    client._cli = SimpleNamespace(update_pending=lambda ids, update: calls.append(("scontrol", ids, update)))
    client._pyslurm = SimpleNamespace(Job=Job, JobSubmitDescription=lambda **kw: kw, RPCError=RuntimeError)
    client.update_pending([5], JobUpdate(partition="h100", gpus_per_node=4, features="", start_now=False))
    assert calls[0] == ("scontrol", [5], JobUpdate(features="", start_now=False))
    assert calls[1][:2] == ("modify", 5) and "constraints" not in calls[1][2]
    assert calls[1][2]["partitions"] == "h100" and calls[1][2]["gres_per_node"] == "gpu:4"
    calls.clear()
    client.update_pending([5], JobUpdate(features="a100", start_now=False))
    assert calls == [("modify", 5, {"constraints": "a100"})]
