"""`slurm-ext profile` as a real Slurm job on the lab, then the estimate that uses it.

The lab's a10 partition has two nodes of two fake GPUs each: the profiling job runs one
process per node under ``srun --mpi=pmi2`` (mpi4py's ranks), the CPU devices stand in for
GPUs (the numbers are CPU numbers; what is tested is the whole path), and rank 0 writes
the store. Afterwards `slurm-ext estimate --profile-db` reports the a10 Cells as
profiled, with times other than the analytic ones.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slurm


def _cli(args, env, cwd, timeout_s=900):
    return subprocess.run([sys.executable, "-m", "slurm_ext", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.scenario
def test_profile_two_nodes_then_estimate_prefers_it(slurm_lab, slurm_client, tmp_path):
    pytest.importorskip("mpi4py", reason="the extra `mpi` (mpi4py and MPICH) is not installed")
    env = {**os.environ, **slurm_lab.env()}
    db = tmp_path / "profiles.sqlite"
    run = _cli(["profile", "--partition", "a10", "--nodes", "2", "--model", "gpt-760m", "--wait",
                "--json", "--profile-db", str(db)], env, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert {"job_id", "partition", "gpu_type", "nodes", "collectives", "compute", "profile_db"} <= set(out)
    assert (out["partition"], out["gpu_type"], out["nodes"], out["profile_db"]) == ("a10", "a10", 2, str(db))
    assert "profile: collectives" in run.stderr  # progress shown while it waited
    assert "2 process(es), 4 cpu devices" in run.stderr  # two ranks, one per node
    spans = {(c["op"], c["group_size"], c["num_nodes"]) for c in out["collectives"]}
    for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
        assert (op, 2, 1) in spans and (op, 2, 2) in spans and (op, 4, 2) in spans
    assert ("send", 2, 1) in spans and ("send", 2, 2) in spans
    assert all(c["seconds"] > 0 for c in out["collectives"])
    kernels = [c for c in out["compute"] if c["kind"] == "kernel"]
    layers = [c for c in out["compute"] if c["kind"] == "layer"]
    assert {k["kernel"] for k in kernels} == {"matmul", "copy"}
    assert {r["layer_index"] for r in layers} == set(range(26))  # every layer of gpt-760m
    assert {r["tp"] for r in layers} == {1, 2, 4}
    assert all(r["forward_backward_s"] > r["forward_s"] > 0 for r in layers)
    assert all(r["backward_temp_bytes"] > 0 for r in layers)  # XLA's compiled temporaries

    est = ["estimate", "--cluster", "lab", "--gpu-type", "a10", "--model", "gpt-760m",
           "--global-batch", "16", "--json"]
    profiled = json.loads(_cli(est + ["--profile-db", str(db)], env, tmp_path, 120).stdout)
    analytic = json.loads(_cli(est, env, tmp_path, 120).stdout)
    cells = [c for c in profiled["cells"] if c["feasible"]]
    assert cells and all(c["fidelity"] == "profiled" for c in cells)
    assert all(c["memory_fidelity"] == "profiled" for c in cells)  # time and memory each profiled
    assert any(c["comm_source"] == "profile" for c in cells)  # cross-node curves measured too
    times = {(c["num_gpus"], c["num_stages"]): c["iteration_time_s"] for c in analytic["cells"] if c["feasible"]}
    assert all(c["iteration_time_s"] != times[(c["num_gpus"], c["num_stages"])] for c in cells)
