import io
import json
import sys

import pytest

from slurm_ext.cli import main

CELL_KEYS = {"gpu_type", "num_gpus", "num_nodes", "gpus_per_node", "num_stages", "stages",
             "iteration_time_s", "samples_per_s", "peak_memory_gb", "feasible", "reason"}


def run(capsys, *args, stdin=None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_contract(capsys):
    code, out, err = run(capsys, "estimate", "--model", "gpt-1.3b", "--global-batch", "256",
                         "--gpus", "8", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert set(d) == {"model", "global_batch", "cells", "best"}
    assert d["model"] == "gpt-1.3b" and d["global_batch"] == 256
    assert {c["num_gpus"] for c in d["cells"]} == {4, 8, 16}
    for c in d["cells"]:
        assert CELL_KEYS <= set(c)
        assert sum(s["dp"] * s["tp"] for s in c["stages"]) == c["num_gpus"] or not c["feasible"]
    feasible = [c for c in d["cells"] if c["feasible"]]
    assert d["best"] == min(feasible, key=lambda c: c["iteration_time_s"])


def test_table_marks_best(capsys):
    code, out, _ = run(capsys, "estimate", "--model", "moe-690m", "--global-batch", "256",
                       "--gpu-type", "a100", "--gpus", "2")
    assert code == 0
    assert "best (*): a100x" in out and out.count("\n* ") == 1


@pytest.mark.parametrize("args, needle", [
    (["--model", "gpt-99b", "--global-batch", "8"], "model='gpt-99b'"),
    (["--model", "gpt-1.3b", "--global-batch", "-4"], "global_batch=-4"),
    (["--model", "gpt-1.3b", "--global-batch", "8", "--gpu-type", "tpu"], "gpu_type='tpu'"),
    (["--model", "gpt-1.3b", "--global-batch", "8", "--gpus", "0"], "gpus=0"),
    (["--model", "gpt-1.3b", "--global-batch", "8", "--cluster", "nowhere"], "cluster='nowhere'"),
    # ZeRO 1-3 of an Adafactor model: plans the runner cannot run, listed as feasible.
    (["--model", "moe-690m", "--global-batch", "32", "--zero", "1"], "moe-690m trains with adafactor"),
])
def test_errors_are_one_line_and_print_nothing(capsys, args, needle):
    code, out, err = run(capsys, "estimate", *args, "--json")
    assert code != 0 and out == ""
    assert needle in err and len(err.strip().splitlines()) == 1


def test_max_stages_keeps_only_cells_the_script_can_run(capsys):
    args = ("estimate", "--model", "gpt-1.3b", "--global-batch", "256", "--gpus", "8", "--json")
    code, out, err = run(capsys, *args)
    assert code == 0, err
    assert any(c["num_stages"] > 1 for c in json.loads(out)["cells"])
    code, out, err = run(capsys, *args, "--max-stages", "1")
    assert code == 0, err
    d = json.loads(out)
    assert d["cells"] and all(c["num_stages"] == 1 for c in d["cells"])
    assert d["best"]["num_stages"] == 1


def test_trainer_api_shows_what_a_script_on_the_runtime_api_runs(capsys, monkeypatch):
    args = ("estimate", "--model", "gpt-1.3b", "--global-batch", "512", "--cluster", "lab", "--gpus", "4", "--json")
    code, out, err = run(capsys, *args, "--max-stages", "1")
    assert code == 0, err
    assert any(c.get("zero_level") for c in json.loads(out)["cells"])
    code, out, err = run(capsys, *args, "--trainer", "api")
    assert code == 0, err
    cells = json.loads(out)["cells"]
    assert cells and all(c["num_stages"] == 1 and not c.get("zero_level") and not c["remat"] for c in cells)
    line = '{"model": "gpt-1.3b", "global_batch": 512, "num_gpus": 4, "trainer": "api"}\n'
    code, out, err = run(capsys, "estimate", "--cluster", "lab", "--batch", "-", stdin=line, monkeypatch=monkeypatch)
    assert code == 0, err
    assert json.loads(out)["cells"] == cells
    code, out, err = run(capsys, *args, "--trainer", "api", "--max-stages", "2")
    assert code != 0 and out == "" and "max_stages=2" in err and len(err.strip().splitlines()) == 1
    for flag in (("--zero", "2"), ("--offload",), ("--remat", "on"), ("--expert-parallel",)):
        code, out, err = run(capsys, *args, "--trainer", "api", *flag)
        assert code != 0 and out == "" and f"{flag[0]} does not apply with --trainer api" in err, flag
    # In a --batch line too, the trainer's plans are ZeRO-0 whatever the flags' level.
    line = '{"model": "gpt-1.3b", "global_batch": 512, "num_gpus": 4, "trainer": "api"}\n'
    code, out, err = run(capsys, "estimate", "--cluster", "lab", "--zero", "2", "--batch", "-", stdin=line,
                         monkeypatch=monkeypatch)
    assert code == 0 and all(not c.get("zero_level") and not c.get("offload") for c in json.loads(out)["cells"])


def test_bad_max_stages_is_one_line(capsys):
    code, out, err = run(capsys, "estimate", "--model", "gpt-1.3b", "--global-batch", "8",
                         "--max-stages", "0")
    assert code != 0 and out == ""
    assert "max_stages=0" in err and len(err.strip().splitlines()) == 1


def test_batch_lines_accept_max_stages(capsys, monkeypatch):
    reqs = [{"model": "gpt-760m", "global_batch": 128, "num_gpus": 4, "max_stages": 1},
            {"model": "gpt-760m", "global_batch": 128, "num_gpus": 4}]
    code, out, err = run(capsys, "estimate", "--batch", "-",
                         stdin="\n".join(json.dumps(r) for r in reqs) + "\n", monkeypatch=monkeypatch)
    assert code == 0, err
    limited, free = (json.loads(x) for x in out.splitlines())
    assert all(c["num_stages"] == 1 for c in limited["cells"])
    assert any(c["num_stages"] > 1 for c in free["cells"])
    bad = '{"model": "gpt-760m", "global_batch": 128, "max_stages": "one"}\n'
    code, out, err = run(capsys, "estimate", "--batch", "-", stdin=bad, monkeypatch=monkeypatch)
    assert code != 0 and out == "" and "line 1.max_stages='one'" in err


def test_malformed_model_yaml(capsys, tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("hidden: 64\nlayers: [\n")
    code, out, err = run(capsys, "estimate", "--model", str(f), "--global-batch", "8")
    assert code != 0 and out == "" and "malformed YAML" in err and "(line 3, column 1)" in err


def test_batch_prints_one_result_per_line_in_order(capsys, monkeypatch):
    reqs = [{"model": "gpt-760m", "global_batch": 128, "gpu_type": "a40", "num_gpus": 2, "gpus_per_node": 2},
            {"model": "moe-690m", "global_batch": 256},
            {"model": "wide_resnet-500m", "global_batch": 256, "gpu_type": "v100", "num_gpus": 4}]
    code, out, err = run(capsys, "estimate", "--batch", "-",
                         stdin="\n".join(json.dumps(r) for r in reqs) + "\n", monkeypatch=monkeypatch)
    assert code == 0, err
    lines = [json.loads(x) for x in out.splitlines()]
    assert [x["model"] for x in lines] == [r["model"] for r in reqs]
    assert {c["gpu_type"] for c in lines[0]["cells"]} == {"a40"}
    assert all(c["gpus_per_node"] <= 2 for c in lines[0]["cells"])


def test_batch_with_a_bad_line_prints_nothing(capsys, monkeypatch):
    stdin = '{"model": "gpt-760m", "global_batch": 128}\n{"model": "gpt-760m", "global_batch": 0}\n'
    code, out, err = run(capsys, "estimate", "--batch", "-", stdin=stdin, monkeypatch=monkeypatch)
    assert code != 0 and out == "" and "line 2.global_batch=0" in err
    code, out, err = run(capsys, "estimate", "--batch", "-", stdin="not json\n", monkeypatch=monkeypatch)
    assert code != 0 and out == "" and "line 1" in err


def test_plan_dimension_flags_reach_the_plan_and_the_memory(capsys):
    """--remat, --zero and --offload set what the Cells are estimated with: the plan string
    carries them, ZeRO-3 and offload take less GPU memory than replicated states on the
    same structure, and settings the runner cannot run say so."""
    def cells(*flags):
        code, out, err = run(capsys, "estimate", "--model", "gpt-1.3b", "--global-batch", "64",
                             "--gpu-type", "a100", "--gpus", "8", "--json", *flags)
        assert code == 0, err
        # structure (Cell, per-stage dp x tp, micro-batches) -> the Cell's JSON
        return {" ".join(c["plan"].split()[:3]): c for c in json.loads(out)["cells"] if c["feasible"]}

    base, no_remat = cells(), cells("--remat", "off")
    assert base and all("remat=1" in c["plan"].split() and c["runnable"] for c in base.values())
    # Without remat some Cells fit only with AdamW's states split over dp (ZeRO-1), which
    # the runner runs.
    assert no_remat and all("remat=0" in c["plan"].split() and c["runnable"] for c in no_remat.values())
    assert {c["zero_level"] for c in no_remat.values()} <= {0, 1}
    def dp1(c):  # no data parallelism anywhere: no states to shard, the plan carries no ZeRO
        return all(s.startswith("dp1tp") for s in c["plan"].split()[1][6:-1].split("|"))

    zero2 = cells("--zero", "2")  # the runner's ZeRO-2: every stage split alike
    assert zero2 and all(c["plan"].endswith("zero=2") != dp1(c) and c["runnable"] for c in zero2.values())
    assert all(len({s.split("tp")[0] for s in c["plan"].split()[1][6:-1].split("|")}) == 1 for c in zero2.values())
    zero3, offload = cells("--zero", "3"), cells("--zero", "2", "--offload")
    # The runner's ZeRO-3: stages split alike, under remat (it gathers inside it).
    assert zero3 and all(c["plan"].endswith("zero=3") != dp1(c) and c["runnable"] for c in zero3.values())
    assert all(len({s.split("tp")[0] for s in c["plan"].split()[1][6:-1].split("|")}) == 1 for c in zero3.values())
    zero3_no_remat = cells("--zero", "3", "--remat", "off")
    assert zero3_no_remat and all("remat=0" in c["plan"].split() and c["runnable"] == dp1(c)
                                  for c in zero3_no_remat.values())
    assert any(not dp1(c) for c in zero3_no_remat.values())
    assert all(c["plan"].endswith("offload=1") and ("zero=2" in c["plan"]) != dp1(c) and not c["runnable"]
               for c in offload.values())
    same = [k for k in base if k in zero3 and k in offload and "dp1tp" not in k]  # data parallel: states shard
    assert same
    for k in same:
        assert zero3[k]["peak_memory_gb"] < base[k]["peak_memory_gb"], k
        assert offload[k]["peak_memory_gb"] < base[k]["peak_memory_gb"], k


def test_expert_parallel_flag_reaches_the_plan(capsys):
    """--expert-parallel offers MoE stages with their experts sharded over data parallelism:
    on two nodes of two V100s moe-2.4b's Cell becomes such a plan, faster and runnable;
    without the flag no stage is marked. (At batch 512 replicated experts fit the V100's
    32 GB, and plain data parallelism is faster.)"""
    def best(*flags):
        code, out, err = run(capsys, "estimate", "--model", "moe-2.4b", "--global-batch", "1024",
                             "--gpu-type", "v100", "--gpus", "4", "--gpus-per-node", "2", "--max-stages", "1",
                             "--json", *flags)
        assert code == 0, err
        return next(c for c in json.loads(out)["cells"] if c["num_gpus"] == 4)

    plain, ep = best(), best("--expert-parallel")
    assert "ep" not in plain["plan"].split()[1] and plain["runnable"]
    assert "plan=[dp4tp1ep]" in ep["plan"] and ep["runnable"] and ep["stages"][0]["ep"] is True
    assert ep["iteration_time_s"] < plain["iteration_time_s"]


def test_expert_parallel_on_a_dense_model_says_it_changes_nothing(capsys):
    args = ("estimate", "--model", "gpt-760m", "--global-batch", "64", "--gpu-type", "a100", "--gpus", "4", "--json")
    code, plain, err = run(capsys, *args)
    assert code == 0 and "expert" not in err
    code, ep, err = run(capsys, *args, "--expert-parallel")
    assert code == 0 and ep == plain
    assert err.strip() == "slurm-ext: note: gpt-760m has no expert layers: --expert-parallel changes nothing"


@pytest.mark.parametrize("args, message", [
    (("explain", "1234_5"), "'1234_5' is not a job id: an array task's own job id"),
    (("explain", "12", "--timeout-s", "0"), "0.0 is not in the range x>0"),
    (("explain", "12", "--timeout-s", "inf"), "'inf' is not a finite number"),  # a traceback
    (("squeue", "--timeout-s", "nan"), "'nan' is not a finite number"),  # "did not finish within nan s"
    (("estimate", "--model", "gpt-760m", "--global-batch", "256", "--micro-batches", "7"),
     "micro_batches=7: must divide the global batch 256"),
    (("estimate", "--model", "gpt-760m", "--global-batch", "64", "--cluster", "{tmp}"), "cannot read: Is a directory"),
    (("estimate", "--model", "gpt-760m", "--global-batch", "64", "--cluster", "{tmp}/binary"), "malformed YAML"),
    (("profile", "--partition", "a10", "--samples", "0"), "0 is not in the range x>=1"),
])
def test_bad_input_is_one_line_not_a_traceback(capsys, tmp_path, args, message):
    (tmp_path / "binary").write_bytes(bytes(range(128, 256)))
    code, out, err = run(capsys, *(a.replace("{tmp}", str(tmp_path)) for a in args))
    assert code == 2 and out == "" and message in err and "Traceback" not in err


def test_batch_values_of_the_wrong_type_are_refused_before_any_estimate(capsys, monkeypatch):
    lines = '{"model": "gpt-760m", "global_batch": 8}\n{"model": 123, "global_batch": 8}\n'
    code, out, err = run(capsys, "estimate", "--batch", "-", stdin=lines, monkeypatch=monkeypatch)
    assert code == 2 and out == "" and "line 2.model=123: a string" in err
    code, out, err = run(capsys, "estimate", "--batch", "-", "--global-batch", "0", stdin=lines,
                         monkeypatch=monkeypatch)
    assert code == 2 and out == "" and "drop --model/--global-batch" in err


def test_batch_lines_a_request_would_refuse_are_refused_before_any_estimate(capsys, monkeypatch):
    """An unknown GPU type, model or count on line 3 was found only after lines 1 and 2 were
    estimated (seconds of work on a long file, thrown away)."""
    import slurm_ext.commands.estimate as estimate_command
    estimated = []
    real = estimate_command._estimate
    monkeypatch.setattr(estimate_command, "_estimate", lambda *a: estimated.append(a) or real(*a))
    good = '{"model": "gpt-760m", "global_batch": 8}\n'
    for bad, says in (('{"model": "gpt-760m", "global_batch": 8, "gpu_type": "h100"}', "line 3.gpu_type='h100'"),
                      ('{"model": "gpt-99b", "global_batch": 8}', "line 3.model='gpt-99b'"),
                      ('{"model": "gpt-760m", "global_batch": 8, "num_gpus": 12}', "line 3.num_gpus='12'"),
                      ('{"model": "gpt-760m", "global_batch": 8, "max_stages": 0}', "line 3.max_stages=0"),
                      ('{"model": "gpt-760m", "global_batch": 8, "trainer": "nope"}', "line 3.trainer='nope'"),
                      ('{"model": "moe-690m", "global_batch": 8}', "--what-if")):
        flags = ("--zero", "1") if "moe" in bad else ()  # ZeRO-1 of an Adafactor model: refused
        code, out, err = run(capsys, "estimate", "--batch", "-", *flags, stdin=good * 2 + bad + "\n",
                             monkeypatch=monkeypatch)
        assert (code, out, estimated) == (2, "", []) and says in err, err
    # An editor's byte-order mark before the first line is no part of its JSON.
    code, out, err = run(capsys, "estimate", "--batch", "-", stdin="\ufeff" + good, monkeypatch=monkeypatch)
    assert code == 0 and len(out.splitlines()) == 1, err


def test_batch_errors_name_the_input_line_and_check_what_one_request_would(capsys, monkeypatch):
    """Blank lines count; --micro-batches is checked against each line's batch; a key given
    as null takes the flag; bytes that are not UTF-8 are one line of error."""
    lines = '{"model": "gpt-760m", "global_batch": 8}\n\n{"model": "gpt-760m", "global_batch": "8"}\n'
    code, out, err = run(capsys, "estimate", "--batch", "-", stdin=lines, monkeypatch=monkeypatch)
    assert code == 2 and out == "" and "line 3.global_batch='8'" in err
    code, out, err = run(capsys, "estimate", "--batch", "-", "--micro-batches", "3",
                         stdin='{"model": "gpt-760m", "global_batch": 8}\n', monkeypatch=monkeypatch)
    assert code == 2 and out == "" and "line 1.micro_batches=3: must divide the global batch 8" in err
    code, out, err = run(capsys, "estimate", "--batch", "-", "--gpus", "4", "--gpu-type", "a100",
                         stdin='{"model": "gpt-760m", "global_batch": 8, "num_gpus": null, "gpu_type": null}\n',
                         monkeypatch=monkeypatch)
    assert code == 0, err
    assert {(c["gpu_type"], c["num_gpus"]) for c in json.loads(out)["cells"]} == {("a100", 2), ("a100", 4), ("a100", 8)}
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe\n"), encoding="utf-8"))
    code = main(["estimate", "--batch", "-"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "line 1" in err and "not UTF-8 text" in err and "Traceback" not in err


def test_a_gpu_count_with_no_cell_is_an_error_or_says_why(capsys):
    code, out, err = run(capsys, "estimate", "--model", "gpt-1.3b", "--global-batch", "8", "--gpus", "6")
    assert code == 2 and out == "" and "gpus='6': not a power of two" in err and "ask for 4 or 8" in err
    # Past the largest count no power of two above is offered (131072 was, then refused).
    code, out, err = run(capsys, "estimate", "--model", "gpt-1.3b", "--global-batch", "8", "--gpus", "100000")
    assert code == 2 and "give at most 65536" in err and "131072" not in err
    code, out, err = run(capsys, "estimate", "--model", "gpt-1.3b", "--global-batch", "8", "--gpus", "131072")
    assert code == 2 and "give at most 65536 GPUs" in err and "not a power of two" not in err
    code, out, err = run(capsys, "estimate", "--model", "gpt-760m", "--global-batch", "8", "--gpus", "1024")
    assert code == 0 and "the cluster has no GPU type with that many GPUs" in out and "try more GPUs" not in out
    # The count asked for does not fit, half of it does: the table says so under the Cells.
    code, out, err = run(capsys, "estimate", "--model", "gpt-760m", "--global-batch", "256", "--gpu-type", "a100",
                         "--gpus", "512")
    assert code == 0 and " a100   256 " in out and "no Cell of 512 GPUs" in out
    code, out, err = run(capsys, "estimate", "--model", "gpt-760m", "--global-batch", "256", "--gpu-type", "a100",
                         "--gpus", "8")
    assert code == 0 and "no Cell of" not in out


def test_batch_lines_take_the_flags_where_they_lack_the_key(capsys, monkeypatch):
    lines = ('{"model": "gpt-760m", "global_batch": 64}\n'
             '{"model": "gpt-760m", "global_batch": 64, "gpu_type": "a10", "num_gpus": 2}\n')
    code, out, err = run(capsys, "estimate", "--batch", "-", "--gpu-type", "a100", "--gpus", "8", "--max-stages", "1",
                         stdin=lines, monkeypatch=monkeypatch)
    assert code == 0, err
    flagged, own = (json.loads(x) for x in out.splitlines())
    assert {(c["gpu_type"], c["num_gpus"]) for c in flagged["cells"]} == {("a100", 4), ("a100", 8), ("a100", 16)}
    assert {(c["gpu_type"], c["num_gpus"]) for c in own["cells"]} == {("a10", 1), ("a10", 2), ("a10", 4)}
    assert all(c["num_stages"] == 1 for d in (flagged, own) for c in d["cells"])


@pytest.mark.parametrize("row, field", [("a,nan,100,2,,", "submit_time_s"), ("a,0,inf,2,,", "duration_s"),
                                        ("a,0,100,-1,,", "num_gpus")])
def test_simulate_refuses_a_trace_row_it_cannot_replay(capsys, tmp_path, row, field):
    trace = tmp_path / "t.csv"
    trace.write_text("job_id,submit_time_s,duration_s,num_gpus,gpu_type,status\n" + row + "\n")
    code, out, err = run(capsys, "simulate", "--trace", str(trace), "--cluster", "crius-1280", "--policy", "fcfs")
    assert code == 2 and out == "" and "t.csv line 2" in err and field in err


def test_simulate_says_which_trace_mapping_it_took_and_takes_the_one_asked_for(capsys, tmp_path):
    """The mapping followed the file's name: a trace renamed itp_* lost every record to
    ITP's submit filter with no word of why."""
    trace = tmp_path / "itp_mine.csv"
    trace.write_text("job_id,submit_time_s,duration_s,num_gpus,gpu_type,status\na,0,3600,2,,\n")
    code, out, err = run(capsys, "simulate", "--trace", str(trace), "--cluster", "crius-1280", "--policy", "fcfs")
    assert code == 2 and "--trace-kind itp skips records submitted before 1,945,572 s" in err
    code, out, err = run(capsys, "simulate", "--trace", str(trace), "--trace-kind", "philly", "--cluster",
                         "crius-1280", "--policy", "fcfs", "--quiet", "--json", "-")
    report = json.loads(out)
    assert code == 0 and report["trace_kind"] == "philly" and report["policies"]["fcfs"]["jobs"] == 1


def test_simulate_refuses_rounds_shorter_than_a_second(capsys, tmp_path):
    """A round of 1e-12 s never let the replay advance (it ran until killed, printing nothing)."""
    trace = tmp_path / "t.csv"
    trace.write_text("job_id,submit_time_s,duration_s,num_gpus,gpu_type,status\na,0,100,2,,\n")
    for value in ("1e-12", "0.5", "0", "nan"):
        code, out, err = run(capsys, "simulate", "--trace", str(trace), "--cluster", "crius-1280",
                             "--policy", "fcfs", "--round-s", value)
        assert code == 2 and "round_s" in err and "at least 1 s" in err and len(err.strip().splitlines()) == 1
    # Nor longer than a day (1e300: gavel and sia left most jobs unfinished, and said nothing).
    code, out, err = run(capsys, "simulate", "--trace", str(trace), "--cluster", "crius-1280",
                         "--policy", "fcfs", "--round-s", "1e300")
    assert code == 2 and "round_s=1e+300: give at most 86400 s" in err


def test_simulate_checks_its_outputs_before_it_simulates(capsys, tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("job_id,submit_time_s,duration_s,num_gpus,gpu_type,status\na,0,100,2,,\n")
    for flag in ("--json", "--markdown"):
        code, out, err = run(capsys, "simulate", "--trace", str(trace), "--cluster", "crius-1280",
                             "--policy", "fcfs", flag, str(tmp_path))
        assert code == 2 and out == "" and "cannot write: Is a directory" in err


def test_table_says_when_the_starred_cell_is_estimated_only(capsys):
    code, out, err = run(capsys, "estimate", "--model", "gpt-6.7b", "--global-batch", "256",
                         "--gpu-type", "a100", "--zero", "3", "--remat", "off")
    assert code == 0, err
    (best,) = [line for line in out.splitlines() if line.startswith("* ")]
    assert "ZeRO-3" in best and "estimated only: the runner cannot run it yet" in best
    cut = [tok for line in out.splitlines() for tok in line.split() if tok.endswith("…")]
    assert cut and all(len(tok) == 28 and tok.startswith("dp") for tok in cut)  # long plans: cut, marked


def test_simulate_refuses_a_cluster_whose_types_have_no_measured_rate(capsys, tmp_path):
    trace, cluster = tmp_path / "t.csv", tmp_path / "h.yaml"
    trace.write_text("job_id,submit_time_s,duration_s,num_gpus,gpu_type,status\na,0,100,2,,\n")
    cluster.write_text("name: h\nnode_groups:\n  - {gpu_type: h200, nodes: 2, gpus_per_node: 8}\n")
    code, out, err = run(capsys, "simulate", "--trace", str(trace), "--cluster", str(cluster), "--policy", "crius")
    assert code == 2 and out == "" and "none of its GPU types (h200) has a measured rate" in err


def test_an_unwritable_compile_cache_is_an_error_not_a_silent_analytic_estimate(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    code, out, err = run(capsys, "estimate", "--model", "gpt-760m", "--global-batch", "64", "--fidelity",
                         "compiled", "--compile-cache", str(tmp_path / "file" / "cache"))
    assert code == 2 and out == "" and "compile_cache=" in err and "cannot write" in err


def test_simulate_refuses_restart_costs_that_are_no_runner_report(capsys, tmp_path):
    trace, report = tmp_path / "t.csv", tmp_path / "r.json"
    trace.write_text("job_id,submit_time_s,duration_s,num_gpus,gpu_type,status\na,0,100,2,,\n")
    report.write_text('{"x": 1}')
    code, out, err = run(capsys, "simulate", "--trace", str(trace), "--cluster", "crius-1280", "--policy", "fcfs",
                         "--restart-costs", str(report))
    assert code == 2 and out == "" and "not a runner's measured.json" in err
    report.write_text('{"startup_s": -5, "final_save_s": 2.0}')  # was dropped, the default used
    code, out, err = run(capsys, "simulate", "--trace", str(trace), "--cluster", "crius-1280", "--policy", "fcfs",
                         "--restart-costs", str(report))
    assert code == 2 and "startup_s=-5.0: a time is never negative" in err


def test_infeasible_note_names_the_stage_that_needs_most(capsys):
    # gpt-6.7b on two a10 in two stages: the last stage (with the head) needs the most.
    code, out, err = run(capsys, "estimate", "--model", "gpt-6.7b", "--global-batch", "64",
                         "--gpu-type", "a10", "--gpus", "4", "--max-stages", "2")
    assert code == 0, err
    (row,) = [line for line in out.splitlines() if "dp1tp1|dp1tp1 " in line and " 2   2 " in line]
    figure = row.split("GB per GPU")[0].split("needs ")[-1].strip()
    assert "stage 1 needs" in row and row.split()[8] == figure  # the GB/GPU column's figure


def test_table_columns_hold_an_absurd_model(capsys, tmp_path):
    spec = tmp_path / "huge.yaml"
    spec.write_text("hidden: 65536\nlayers: 64\nheads: 64\nsequence: 65536\nvocab: 4194304\n")
    code, out, err = run(capsys, "estimate", "--model", str(spec), "--global-batch", "8",
                         "--gpu-type", "a100", "--gpus", "8")
    assert code == 0, err
    rows = out.splitlines()[2:-1]
    assert all(len(r.split()[8]) <= 6 for r in rows) and any("e+" in r.split()[8] for r in rows)
    head = out.splitlines()[1]
    assert all(r.index(r.split()[8]) + len(r.split()[8]) == head.index("GB/GPU") + 6 for r in rows)


def test_cells_without_a_power_of_two_split_say_so_and_show_no_memory():
    # The command refuses such a count; a job of a trace (or another caller) may still ask.
    from estimator.cluster import load_cluster
    from estimator.estimate import EstimateOptions, estimate_job
    from estimator.jobs import JobSpec
    from slurm_ext.commands.estimate import _table

    out = _table(estimate_job(JobSpec("gpt-760m", 64, 3, "a100"), load_cluster("crius-1280"), EstimateOptions(),
                              ("a100",)))
    refused = [line for line in out.splitlines() if "power-of-two" in line]
    assert {line.split()[1] for line in refused} == {"3", "6"}
    assert all(line.split()[8] == "-" for line in refused)
    assert "3 over 1 stage gives 3" in out and "6 over 2 stages gives 3" in out


def test_arena_stage_counts_with_zero2_retries_do_not_crash(capsys):
    # gpt-6.7b does not fit some Cells as planned: they are retried under ZeRO-2, whose
    # runner rule (stages split alike) no Arena plan of unequal counts can meet.
    code, out, err = run(capsys, "estimate", "--model", "gpt-6.7b", "--global-batch", "256",
                         "--gpu-type", "a10", "--stage-gpus", "arena", "--json")
    assert code == 0, err
    cells = json.loads(out)["cells"]
    assert any(c["feasible"] for c in cells) and json.loads(out)["best"] is not None


def test_a_profile_store_from_the_environment_is_named_as_such_when_it_is_missing(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_EXT_PROFILE_DB", str(tmp_path / "missing.db"))
    code, out, err = run(capsys, "estimate", "--model", "gpt-760m", "--global-batch", "64")
    assert code == 2 and out == "" and "env var: 'SLURM_EXT_PROFILE_DB'" in err and "missing.db" in err
    monkeypatch.setenv("SLURM_EXT_PROFILE_DB", "")  # set but empty: no store
    code, out, err = run(capsys, "estimate", "--model", "gpt-760m", "--global-batch", "64", "--gpus", "4",
                         "--gpu-type", "a100", "--json")
    assert code == 0 and json.loads(out)["cells"]


def test_a_profile_that_submits_nothing_leaves_no_empty_store(capsys, tmp_path, monkeypatch):
    """The store is made first (a path that is no store fails before minutes of measuring);
    when Slurm cannot be reached and nothing is submitted, the new empty file is removed.
    A store that was there stays."""
    monkeypatch.setenv("SLURM_EXT_SLURM_PREFIX", str(tmp_path / "no-slurm"))
    db = tmp_path / "profiles.sqlite"
    code, out, err = run(capsys, "profile", "--partition", "gpu", "--profile-db", str(db))
    assert code != 0 and "not found" in err and not db.exists()
    from estimator.profile_store import connect
    connect(str(db), create=True).close()
    code, out, err = run(capsys, "profile", "--partition", "gpu", "--profile-db", str(db))
    assert code != 0 and db.exists()


def test_a_daemon_on_a_state_file_another_daemon_holds_stops_with_one_line(capsys, tmp_path):
    """Two daemons acting on one state file would signal and release the same jobs twice."""
    import os

    from slurm_ext.store import lock_state_file

    state = tmp_path / "state.db"
    held = lock_state_file(state)
    try:
        code, out, err = run(capsys, "daemon", "--once", "--state-db", str(state))
    finally:
        os.close(held)
    assert code == 1 and f"(pid {os.getpid()}) acts on {state}" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_gpus_per_node_that_no_cell_can_use_is_an_error_not_another_layout(capsys):
    """3 was read as 2, and 4 on the 2-GPU a40 nodes left every a40 Cell out."""
    code, out, err = run(capsys, "estimate", "--model", "gpt-1.3b", "--global-batch", "64", "--gpus-per-node", "3")
    assert code == 2 and out == "" and "gpus_per_node=3: give a power of two" in err
    code, out, err = run(capsys, "estimate", "--model", "gpt-1.3b", "--global-batch", "64", "--gpus", "8",
                         "--gpu-type", "a40", "--gpus-per-node", "4")
    assert code == 2 and "no node that large" in err and "a40 2" in err
    code, out, err = run(capsys, "estimate", "--model", "gpt-1.3b", "--global-batch", "64", "--gpus", "8",
                         "--gpu-type", "a40", "--gpus-per-node", "2")
    assert code == 0 and " a40 " in out


def test_a_bad_flag_under_batch_is_the_flags_error_and_a_bad_line_names_its_key(capsys, monkeypatch):
    line = '{"model": "gpt-760m", "global_batch": 64}\n'
    code, out, err = run(capsys, "estimate", "--batch", "-", "--gpus", "6", stdin=line, monkeypatch=monkeypatch)
    assert code == 2 and err.startswith("slurm-ext: error: gpus='6'") and "line 1" not in err
    own = '{"model": "gpt-760m", "global_batch": 64, "num_gpus": 6}\n'
    code, out, err = run(capsys, "estimate", "--batch", "-", stdin=own, monkeypatch=monkeypatch)
    assert code == 2 and "line 1.num_gpus='6'" in err


def test_compiled_only_options_without_compiled_fidelity_are_refused(capsys, tmp_path):
    code, out, err = run(capsys, "estimate", "--model", "gpt-760m", "--global-batch", "8",
                         "--gpu-specs-dir", str(tmp_path))
    assert code == 2 and out == "" and "--gpu-specs-dir only applies with --fidelity compiled" in err


@pytest.mark.parametrize("command", ["estimate", "tune"])
def test_a_cluster_from_the_environment_that_does_not_load_names_the_variable(capsys, monkeypatch, command):
    monkeypatch.setenv("SLURM_EXT_CLUSTER", "nope")
    args = (command, "--model", "gpt-760m", "--global-batch", "8", "--gpu-type", "a10", "--gpus", "2")
    code, out, err = run(capsys, *args)
    assert code == 2 and out == "" and "$SLURM_EXT_CLUSTER='nope': neither a built-in" in err
    # Given on the command line, it is the option's error; the variable is not consulted.
    code, out, err = run(capsys, *args, "--cluster", "nope2")
    assert code == 2 and "cluster='nope2'" in err and "SLURM_EXT_CLUSTER" not in err
    monkeypatch.setenv("SLURM_EXT_CLUSTER", "lab")
    code, out, err = run(capsys, "estimate", "--model", "gpt-760m", "--global-batch", "8", "--gpu-type", "a10")
    assert code == 0 and "best (*): a10x" in out


def test_simulate_takes_a_quoted_glob_of_restart_reports(capsys, tmp_path):
    """As the help and docs/simulation.md say: 'ROOT/*/measured.json', expanded here."""
    import json as json_module
    trace = tmp_path / "t.csv"
    trace.write_text("job_id,submit_time_s,duration_s,num_gpus,gpu_type,status\na,0,100,2,,\n")
    for job, resume_s in (("1", 100.0), ("2", 110.0), ("3", 120.0)):
        (tmp_path / "root" / job).mkdir(parents=True)
        (tmp_path / "root" / job / "measured.json").write_text(json_module.dumps(
            {"job_id": job, "restart_count": 1, "startup_s": resume_s, "final_save_s": 2.0}))
    args = ("simulate", "--trace", str(trace), "--cluster", "crius-1280", "--policy", "fcfs", "--quiet", "--json", "-")
    code, out, err = run(capsys, *args, "--restart-costs", str(tmp_path / "root" / "*" / "measured.json"))
    assert code == 0, err
    globbed = json_module.loads(out)["policies"]["fcfs"]["costs"]
    each = [a for job in ("1", "2", "3") for a in ("--restart-costs", str(tmp_path / "root" / job / "measured.json"))]
    code, out, err = run(capsys, *args, *each)
    assert code == 0 and json_module.loads(out)["policies"]["fcfs"]["costs"] == globbed
    assert globbed["checkpoint_resume_s"] == 110.0 + 2.0  # the median of the three resumes, and the save
    code, out, err = run(capsys, *args, "--restart-costs", str(tmp_path / "none" / "*.json"))
    assert code == 2 and "matches no file" in err
