"""The profile store, the efficiency fit and the estimator's use of a profile.

The fit must recover known parameters from timings generated with them; the estimator
must prefer a profiled GPU type's measurements (``fidelity: profiled``) and fall back
cleanly to the analytic model for types and layers the store lacks.
"""

import math
import sqlite3
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from estimator.cluster import load_cluster
from estimator.comm import collective_time, load_comm_table, with_profiled
from estimator.compute import Efficiency, efficiency, layer_time_s
from estimator.errors import SpecError
from estimator.estimate import EstimateOptions, estimate_job
from estimator.gpus import gpu_type
from estimator.jobs import JobSpec
from estimator.models import load_model
from estimator.profile_fit import fit_efficiency, fit_rate, fingerprints, profiled_layer_s
from estimator.profile_store import (CollectiveRow, KernelRow, LayerRow, LayerTiming, Profile,
                                     ProfileInfo, collective_csv_rows, connect, load_profile_view,
                                     model_fingerprint, read_profile, write_profile)

ROOT = Path(__file__).resolve().parents[1]
TRUE = Efficiency(matmul_frac=0.55, conv_frac=0.4, memory_frac=0.8, layer_overhead_s=120e-6,
                  half_rate_gflop=30.0, inter_node_frac=0.7)


def _kernels(gpu, eff: Efficiency, noise=()) -> list[KernelRow]:
    """Timings as the efficiency model says a device with ``eff`` would show them."""
    rows, rate = [], gpu.peak_tflops("bf16") * 1e12 * eff.matmul_frac
    h = eff.half_rate_gflop * 1e9
    for i, n in enumerate((256, 512, 1024, 2048, 4096, 8192)):
        f = 2.0 * n ** 3
        jitter = noise[i] if i < len(noise) else 1.0
        rows.append(KernelRow("matmul", "bf16", f"{n},{n},{n}", f, 6.0 * n * n, (f + h) / rate * jitter))
        rows.append(KernelRow("matmul", "fp32", f"{n},{n},{n}", f, 12.0 * n * n,
                              (f + h) / (gpu.fp32_tflops * 1e12 * eff.conv_frac)))
    bw = gpu.memory_bandwidth_gbytes_s * 1e9 * eff.memory_frac
    for nbytes in (1 << 22, 1 << 24, 1 << 26, 1 << 28):
        rows.append(KernelRow("copy", "fp32", str(nbytes // 4), 0.0, 2.0 * nbytes, 2.0 * nbytes / bw + 5e-6))
    return rows


def _layers(spec, gpu, eff: Efficiency, tps=(1, 2), samples=(1, 2, 4)) -> list[LayerRow]:
    fp = model_fingerprint(spec)
    return [LayerRow(spec.name, fp, i, layer.kind, tp, m,
                     layer_time_s(layer, gpu, eff, spec.dtype, m, tp, 1.0),
                     layer_time_s(layer, gpu, eff, spec.dtype, m, tp, 3.0))
            for i, layer in enumerate(spec.layers) for tp in tps for m in samples]


def test_fit_rate_recovers_rate_and_half_work():
    work = [1e6, 1e7, 1e8, 1e9, 1e10]
    fit = fit_rate(work, [(w + 3e7) / 2e12 for w in work])
    assert fit.rate == pytest.approx(2e12, rel=1e-3)
    assert fit.half_work == pytest.approx(3e7, rel=1e-2)
    assert fit.median_rel_error < 1e-3


def test_fit_recovers_known_parameters_from_synthetic_measurements():
    gpu = gpu_type("h100")
    spec = load_model("gpt-760m")
    # One matmul 40 % slow (a noisy run): the robust fit must not follow it.
    kernels = _kernels(gpu, TRUE, noise=(1.0, 1.0, 1.4))
    eff, err = fit_efficiency(gpu, "bf16", kernels, _layers(spec, gpu, TRUE),
                              fingerprints([spec]), base=replace(TRUE, layer_overhead_s=0.0))
    assert eff.matmul_frac == pytest.approx(TRUE.matmul_frac, rel=0.02)
    assert eff.half_rate_gflop == pytest.approx(TRUE.half_rate_gflop, rel=0.05)
    assert eff.conv_frac == pytest.approx(TRUE.conv_frac, rel=0.02)
    assert eff.memory_frac == pytest.approx(TRUE.memory_frac, rel=0.02)
    assert eff.layer_overhead_s == pytest.approx(TRUE.layer_overhead_s, rel=0.05)
    assert eff.inter_node_frac == TRUE.inter_node_frac  # a profile says nothing about it
    assert err < 0.01


def test_fit_keeps_base_parameters_where_the_profile_says_nothing():
    gpu = gpu_type("a10")
    base = efficiency(gpu)
    eff, err = fit_efficiency(gpu, "bf16", [k for k in _kernels(gpu, TRUE) if k.kernel == "copy"])
    assert eff.memory_frac == pytest.approx(TRUE.memory_frac, rel=0.02)
    assert (eff.matmul_frac, eff.half_rate_gflop, eff.layer_overhead_s) == \
        (base.matmul_frac, base.half_rate_gflop, base.layer_overhead_s)


def test_profiled_layer_time_interpolates_and_extrapolates():
    t = LayerTiming((1, 2, 4), (1.0, 1.5, 2.5), (3.0, 4.5, 7.5))
    assert profiled_layer_s(t, 2, remat=False) == pytest.approx(4.5)
    assert profiled_layer_s(t, 3, remat=False) == pytest.approx(6.0)
    assert profiled_layer_s(t, 3, remat=True) == pytest.approx(6.0 + 2.0)
    assert profiled_layer_s(t, 8, remat=False) == pytest.approx(7.5 + 4 * 1.5)  # last interval's slope
    assert profiled_layer_s(t, 0.5, remat=False) == pytest.approx(1.5)
    one = LayerTiming((2,), (1.0,), (3.0,))
    assert profiled_layer_s(one, 6, remat=False) == pytest.approx(9.0)
    # A last interval flattened by jitter: past it, at least the average cost per sample
    # above the smallest measurement ((6.1 − 3.0) / 15), not the last interval's 0.1 / 12.
    flat = LayerTiming((1, 4, 16), (1.0, 2.0, 2.05), (3.0, 6.0, 6.1))
    assert profiled_layer_s(flat, 32, remat=False) == pytest.approx(6.1 + 16 * 3.1 / 15)


def _profile(tmp_path, gpu_name="a10", eff=TRUE, layers=True, collectives=True):
    gpu, spec = gpu_type(gpu_name), load_model("gpt-760m")
    rows = []
    if collectives:
        for nbytes in (1 << 16, 1 << 20, 1 << 24):
            rows.append(CollectiveRow("all-reduce", 2, 1, 2, "[[0, 1]]", nbytes, 1e-3 + nbytes / 1e9))
    info = ProfileInfo(gpu_name, 1, 2, "gpu", "2026-11-26T00:00:00+00:00", "7", gpu_name, ("n1",), "dev",
                       {"jax": "x"})
    db = tmp_path / "p.sqlite"
    pid = write_profile(db, Profile(info, tuple(rows), tuple(_kernels(gpu, eff)),
                                    tuple(_layers(spec, gpu, eff, tps=(1, 2), samples=(1, 2, 4, 8))
                                          if layers else ()), eff, 0.01))
    return db, pid


def test_store_round_trip_and_summary(tmp_path):
    db, pid = _profile(tmp_path)
    p = read_profile(db, pid)
    assert p.info.gpu_type == "a10" and p.info.node_names == ("n1",) and p.info.versions == {"jax": "x"}
    assert len(p.collectives) == 3 and p.efficiency == TRUE
    assert len(p.layers) == 26 * 2 * 4
    view = load_profile_view(db)
    assert view.efficiencies["a10"] == TRUE
    fp = model_fingerprint(load_model("gpt-760m"))
    assert view.layer_timing("a10", fp, 5, 2).samples == (1, 2, 4, 8)
    assert view.layer_timing("a10", fp, 5, 4) is None
    with sqlite3.connect(db) as conn:  # its versions edited by hand into something unreadable
        conn.execute("UPDATE profiles SET versions_json='{jax' WHERE id=?", (pid,))
    conn.close()
    assert read_profile(db, pid).info.versions == {}


def test_the_view_keeps_the_newest_of_each_measurement_not_of_each_type(tmp_path):
    """Later profiles replace what they measured again, and only that: a one-node profile
    keeps an earlier two-node one's cross-node curves, a profile cut short after tp 1 keeps
    an earlier one's tp 2, a model timed twice in one profile is averaged (it divided by
    zero), and an online refit counts only if made after the type's newest profile."""
    from estimator.profile_store import write_refit

    gpu, spec = gpu_type("a10"), load_model("gpt-760m")
    fp, db = model_fingerprint(spec), tmp_path / "p.sqlite"

    def info(nodes, when):
        return ProfileInfo("a10", nodes, 2, "gpu", when, "7", "a10", ("n1",), "dev", {"jax": "x"})

    cross = tuple(CollectiveRow("all-reduce", 4, 2, 2, "[[0, 1, 2, 3]]", n, 1e-3 + n / 1e8) for n in (1 << 16, 1 << 20))
    within = tuple(CollectiveRow("all-reduce", 2, 1, 2, "[[0, 1]]", n, 1e-3 + n / 1e9) for n in (1 << 16, 1 << 20))
    full = tuple(_layers(spec, gpu, TRUE, tps=(1, 2), samples=(1, 4, 16)))
    # The two-node profile measured within a node too, ten times slower: the newer one-node
    # profile's curves within a node replace those (their median took the older, slower one).
    old_within = tuple(replace(r, seconds=10 * r.seconds) for r in within)
    write_profile(db, Profile(info(2, "2026-11-01T00:00:00+00:00"), cross + old_within, tuple(_kernels(gpu, TRUE)),
                              full, TRUE, 0.01))
    write_refit(db, "a10", replace(TRUE, matmul_frac=0.4), 12, 0.2, 0.05, "test", "2026-11-02T00:00:00Z")
    newer = replace(TRUE, matmul_frac=0.7)
    tp1 = tuple(replace(r, forward_s=2 * r.forward_s) for r in _layers(spec, gpu, TRUE, tps=(1,), samples=(1, 4, 16)))
    write_profile(db, Profile(info(1, "2026-11-03T00:00:00+00:00"), within, tuple(_kernels(gpu, newer)),
                              tp1 + tp1, newer, 0.01))
    view = load_profile_view(db)
    assert view.efficiencies["a10"] == newer  # the refit predates this profile
    assert {(r.num_nodes, r.group_size) for r in view.collectives["a10"]} == {(2, 4), (1, 2)}
    assert sorted(r.seconds for r in view.collectives["a10"] if r.num_nodes == 1) == sorted(r.seconds for r in within)
    again, kept = view.layer_timing("a10", fp, 5, 1), view.layer_timing("a10", fp, 5, 2)
    assert again.samples == (1, 4, 16) and kept.samples == (1, 4, 16)
    first = next(r for r in full if (r.layer_index, r.tp, r.samples) == (5, 1, 4))
    assert again.forward_s[1] == pytest.approx(2 * first.forward_s)
    assert kept.forward_s[1] == pytest.approx(next(r for r in full if (r.layer_index, r.tp, r.samples) == (5, 2, 4)).forward_s)
    write_refit(db, "a10", replace(TRUE, matmul_frac=0.45), 12, 0.2, 0.05, "test", "2026-11-04T00:00:00Z")
    assert load_profile_view(db).efficiencies["a10"].matmul_frac == 0.45


def test_not_a_store_is_one_clear_error(tmp_path):
    bad = tmp_path / "bad.sqlite"
    bad.write_text("not sqlite at all, just text" * 10)
    with pytest.raises(SpecError, match="profile_db"):
        connect(bad)
    with pytest.raises(SpecError, match="run `slurm-ext profile` first"):
        connect(tmp_path / "missing.sqlite")
    odd = tmp_path / "odd.sqlite"
    connect(odd, create=True).close()
    with sqlite3.connect(odd) as conn:
        conn.execute("UPDATE meta SET value='2.1' WHERE key='schema_version'")
    with pytest.raises(SpecError, match="schema version '2.1' is not a number"):
        connect(odd)
    # Another program's database, given as the store to write: refused, not added to.
    other = tmp_path / "users.sqlite"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE users (name TEXT)")
    conn.close()
    with pytest.raises(SpecError, match="a SQLite file of something else \\(tables: users\\)"):
        connect(other, create=True)
    with sqlite3.connect(other) as conn:
        assert [n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")] == ["users"]
    conn.close()


def test_a_damaged_store_is_one_line_and_the_estimates_go_on_without_it(tmp_path):
    """Pages of a store overwritten (its header intact): reading it raised sqlite3's own
    error, which failed every daemon round and was a traceback on the command line."""
    from slurm_ext.observe import estimate_cells

    db, _ = _profile(tmp_path)
    with open(db, "r+b") as f:
        f.seek(4096 * 3)
        f.write(bytes(range(256)) * 16 * 4)
    with pytest.raises(SpecError, match="profile_db=.*cannot be read"):
        load_profile_view(db)
    warned = []
    options = EstimateOptions(profile_db=str(db))
    cells = estimate_cells(JobSpec("gpt-760m", 16), load_cluster("lab"), options, warned.append)
    assert any(c.feasible for c in cells) and all(c.fidelity == "analytic" for c in cells)
    assert len(warned) == 1 and "cannot be read" in warned[0] and "estimates without it" in warned[0]


def test_profiled_collectives_replace_the_shipped_curves_of_their_type(tmp_path):
    db, _ = _profile(tmp_path)
    view = load_profile_view(db)
    base = load_comm_table()
    table = with_profiled(base, collective_csv_rows("a10", view.collectives["a10"]))
    t = collective_time(table, "all-reduce", 2, 1, 1 << 20, "a10", "default", 25.0)
    assert t.source == "profile" and t.seconds == pytest.approx(1e-3 + (1 << 20) / 1e9, rel=1e-6)
    other = collective_time(table, "all-reduce", 2, 1, 1 << 20, "a100", "default", 25.0)
    assert other == collective_time(base, "all-reduce", 2, 1, 1 << 20, "a100", "default", 25.0)


def test_estimate_prefers_the_profile_and_falls_back_cleanly(tmp_path):
    # Profiled layers that are 3x slower than the analytic model of the same type: the
    # profiled Cells must follow the profile; an unprofiled type must stay analytic.
    slow = replace(efficiency(gpu_type("a10")), matmul_frac=efficiency(gpu_type("a10")).matmul_frac / 3)
    db, _ = _profile(tmp_path, eff=slow)
    cluster = load_cluster("lab")
    job = JobSpec("gpt-760m", 16, None, None)
    analytic = estimate_job(job, cluster, EstimateOptions(), ("a10", "a100"))
    profiled = estimate_job(job, cluster, EstimateOptions(profile_db=str(db)), ("a10", "a100"))
    by_cell = {e.cell: e for e in analytic.cells}
    a10 = [e for e in profiled.cells if e.cell.gpu_type == "a10" and e.feasible]
    assert a10 and all(e.fidelity == "profiled" for e in a10)
    assert all(e.iteration_time_s > 1.5 * by_cell[e.cell].iteration_time_s for e in a10)
    a100 = [e for e in profiled.cells if e.cell.gpu_type == "a100"]
    assert all(e.fidelity == "analytic" and e == by_cell[e.cell] for e in a100)
    # A model the profile did not time still gets the type's fitted efficiency.
    other = estimate_job(JobSpec("gpt-1.3b", 16, None, None), cluster,
                         EstimateOptions(profile_db=str(db)), ("a10",))
    base = estimate_job(JobSpec("gpt-1.3b", 16, None, None), cluster, EstimateOptions(), ("a10",))
    feasible = [e for e in other.cells if e.feasible]
    assert feasible and all(e.fidelity == "profiled" for e in feasible)
    assert {e.cell: e.iteration_time_s for e in feasible} != \
        {e.cell: e.iteration_time_s for e in base.cells if e.feasible}


def test_a_store_with_only_an_online_refit_of_a_type_uses_it_and_says_analytic(tmp_path):
    """The daemon writes a refit into a store no profile has been written to: the refitted
    efficiency is used, but nothing of the type was profiled."""
    from estimator.profile_store import write_refit
    db = str(tmp_path / "refit-only.sqlite")
    a10 = efficiency(gpu_type("a10"))
    write_refit(db, "a10", replace(a10, matmul_frac=a10.matmul_frac / 3), 3, 0.4, 0.05, "job 1: +40 %",
                "2026-11-02T00:00:00Z")
    job, cluster = JobSpec("gpt-760m", 16, None, None), load_cluster("lab")
    base = {e.cell: e for e in estimate_job(job, cluster, EstimateOptions(), ("a10",)).cells if e.feasible}
    refitted = [e for e in estimate_job(job, cluster, EstimateOptions(profile_db=db), ("a10",)).cells if e.feasible]
    assert refitted and all(e.fidelity == "analytic" for e in refitted)
    assert all(e.iteration_time_s > 1.1 * base[e.cell].iteration_time_s for e in refitted), \
        [round(e.iteration_time_s / base[e.cell].iteration_time_s, 2) for e in refitted]


def test_profiled_layers_drive_the_stage_time(tmp_path):
    # Layers profiled with an efficiency different from the one fitted for the type: the
    # Cell's compute must come from the layer timings, not from the fitted parameters.
    db, _ = _profile(tmp_path, eff=TRUE)
    with connect(db) as conn:
        conn.execute("UPDATE layers SET forward_s = forward_s * 10, forward_backward_s = forward_backward_s * 10")
    cluster = load_cluster("lab")
    job = JobSpec("gpt-760m", 16, 1, "a10")
    # gpt-760m needs ~30 GB on one GPU in the runner's program: on one 24 GB a10 it fits
    # only with ZeRO-Offload, which a what-if estimate counts (the compute is the same).
    slow = estimate_job(job, cluster, EstimateOptions(profile_db=str(db), runnable_only=False), ("a10",))
    one = next(e for e in slow.cells if e.cell.num_gpus == 1 and e.feasible)
    spec, gpu = load_model("gpt-760m"), gpu_type("a10")
    compute = sum(layer_time_s(layer, gpu, TRUE, spec.dtype, 16 / one.micro_batches, 1, 4.0)
                  for layer in spec.layers)  # remat: forward + backward + recompute
    assert one.iteration_time_s > 5 * compute
    assert math.isfinite(one.iteration_time_s)


def test_fit_rate_stays_physical_when_timings_do_not_grow_with_work():
    # Noisy stand-in timings (a CPU under load): the fit must stay within the bounds the
    # calibration sizes allow instead of running off to an infinite rate.
    work = [1e6, 1e7, 1e8]
    fit = fit_rate(work, [1e-3, 1.2e-3, 1.1e-3])
    assert 1e8 / 1.1e-3 <= fit.rate <= 2 * 1e8 / 1.1e-3
    assert fit.half_work <= 1e8


def test_activation_bytes_per_sample_is_the_slope_of_the_compiled_temporaries():
    """Workspace that does not grow with the batch (the intercept) is left out."""
    t = LayerTiming((1, 2, 4, 8), (1.0,) * 4, (3.0,) * 4, (1100, 2100, 4100, 8100))
    assert t.activation_bytes_per_sample() == pytest.approx(1000.0)
    assert LayerTiming((4,), (1.0,), (3.0,), (4000,)).activation_bytes_per_sample() == 1000.0
    assert LayerTiming((1, 2), (1.0, 1.0), (3.0, 3.0), (None, None)).activation_bytes_per_sample() is None
    assert LayerTiming((1, 2), (1.0, 1.0), (3.0, 3.0)).activation_bytes_per_sample() is None


def test_profiled_activations_set_the_memory_and_say_so(tmp_path):
    """Layers whose compiled temporaries are known give the stage's activation memory
    (memory_fidelity: profiled), worked by hand for two a10s (tp 2) without remat; a store
    without them leaves the memory analytic; time and memory are reported apart."""
    from estimator.cells import Cell
    from estimator.estimate import estimate_cell
    from estimator.memory import activation_bytes
    db, _ = _profile(tmp_path, eff=TRUE)
    job, cluster = JobSpec("gpt-760m", 8, 2, "a10"), load_cluster("lab")
    cell = Cell("a10", 2, 2, 1)
    # tp 2 is the plan either way (dp 2 keeps whole states and a whole layer's activations
    # on a 24 GB a10), fitting or not.
    opts = EstimateOptions(profile_db=str(db), remat=False, micro_batches=1)
    without = estimate_cell(job, cell, cluster, opts)
    assert without.fidelity == "profiled" and without.memory_fidelity == "analytic"
    spec = load_model("gpt-760m")
    # Bytes one sample holds through any layer at each tp, as "compiled": 0.8 of the
    # formula's mean, so that the activations still set the peak (rather than the
    # optimizer update).
    def mean_bytes(tp):
        return 0.8 * sum(activation_bytes(layer, tp) for layer in spec.layers) / len(spec.layers)
    per_sample = mean_bytes(2)
    with connect(db) as conn:
        for tp in (1, 2, 4, 8):
            conn.execute("UPDATE layers SET backward_temp_bytes = 500 + samples * ? WHERE tp = ?",
                         (mean_bytes(tp), tp))
    with_bytes = estimate_cell(job, cell, cluster, opts)
    assert with_bytes.memory_fidelity == "profiled" and with_bytes.fidelity == "profiled"
    assert with_bytes.stages == without.stages and with_bytes.stages[0].tp == 2
    analytic_acts = 8 * sum(activation_bytes(layer, 2) for layer in spec.layers)
    profiled_acts = 8 * per_sample * len(spec.layers)
    assert with_bytes.peak_memory_gb - without.peak_memory_gb == pytest.approx(
        (profiled_acts - analytic_acts) / 1e9, rel=1e-6)


def test_a_version_1_store_is_upgraded_when_opened(tmp_path):
    import sqlite3
    db, pid = _profile(tmp_path)
    with sqlite3.connect(db) as conn:  # make it look like a version-1 store
        conn.execute("ALTER TABLE layers DROP COLUMN backward_temp_bytes")
        conn.execute("UPDATE meta SET value='1' WHERE key='schema_version'")
    conn.close()
    p = read_profile(db, pid)
    assert p.layers and all(r.backward_temp_bytes is None for r in p.layers)
    with connect(db) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == ("2",)
    # An upgrade an older version left half done (its column added, the version not):
    # finished, not refused for ever as "duplicate column".
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE meta SET value='1' WHERE key='schema_version'")
    conn.close()
    assert read_profile(db, pid).layers


def test_compile_all_on_threads_gives_the_programs_one_by_one_gives():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from job_scripts.profile_measure import compile_all
    x = jnp.asarray(np.arange(12.0, dtype=np.float32).reshape(3, 4))
    programs = [(jax.jit(lambda a: a @ a.T), (x,)), (jax.jit(lambda a: jnp.tanh(a).sum(0)), (x,)),
                (jax.jit(lambda a: a * 3.0), (x,))]
    serial, threaded = compile_all(programs, 1), compile_all(programs, 3)
    for (fn, args), (c1, t1), (c3, t3) in zip(programs, serial, threaded):
        np.testing.assert_allclose(np.asarray(c3(*args)), np.asarray(fn(*args)), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(c1(*args)), np.asarray(fn(*args)), rtol=1e-6)
        assert t1 == t3 and (t3 is None or t3 >= 0)


def _profile_cli(tmp_path, name, *extra):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    db = tmp_path / f"{name}.sqlite"
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("SLURM_NTASKS", None)
    out = subprocess.run([sys.executable, "-m", "job_scripts.profile", "--profile-db", str(db), "--gpu-type", "a10",
                          "--model", str(root / "tests/fixtures/runner/tiny-gpt.yaml"), "--skip-collectives",
                          "--max-tp", "2", "--devices-per-node", "2", *extra],
                         capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert out.returncode == 0, out.stderr
    done = next(line for line in out.stdout.splitlines() if line.startswith("profile: done "))
    return json.loads(done[len("profile: done "):]), db


def test_a_spent_time_budget_still_fits_and_writes_what_was_measured(tmp_path):
    # tiny-gpt: 3 distinct layer kinds x tp 1, 2 x 1 sample count (CPU settings) = 6 shares
    full, full_db = _profile_cli(tmp_path, "full")
    assert full["layer_shares_untimed"] == 0 and full["layers"] > 0 and full["kernels"] > 0
    cut, cut_db = _profile_cli(tmp_path, "cut", "--budget-s", "0", "--compile-workers", "1")
    assert cut["layer_shares_untimed"] == 6 and cut["layers"] == 0
    assert cut["kernels"] == full["kernels"]  # calibration is measured before the layers
    stored = read_profile(cut_db, cut["profile_id"])
    assert len(stored.kernels) == cut["kernels"] and stored.layers == ()
    assert len(read_profile(full_db, full["profile_id"]).layers) == full["layers"]


def test_kept_gpu_store_still_matches_its_models():
    """The H200 store kept in benchmarks/ was profiled before LayerSpec gained its MoE
    fields: the shipped models' fingerprints must still find its layer timings."""
    view = load_profile_view(ROOT / "benchmarks" / "results_profile_h200.sqlite")
    for name in ("gpt-760m", "gpt-1.3b"):
        spec = load_model(name)
        fp = model_fingerprint(spec)
        assert view.layer_timing("h200", fp, 1, 1) is not None, name


def test_a_model_named_twice_is_profiled_once():
    from job_scripts.profile import unique_models

    assert unique_models(["gpt-760m", "GPT-760M", "moe-690m", "gpt-760m"]) == ["gpt-760m", "moe-690m"]


def test_a_gpu_node_whose_jax_has_no_cuda_plugin_is_not_profiled_as_cpu(monkeypatch, tmp_path):
    """The profile would be stored as the GPU type's efficiency, ten thousand times slow."""
    from job_scripts import profile, runtime

    device = tmp_path / "nvidiactl"
    device.write_text("")
    monkeypatch.setattr(profile, "NVIDIA_DEVICE", str(device))
    monkeypatch.setattr(runtime, "gpu_available", lambda: False)
    with pytest.raises(SpecError, match="NVIDIA GPUs but JAX here has no CUDA plugin"):
        profile._configure(SimpleNamespace(rank=0, size=1), {}, 2)


def test_waiting_on_a_profile_reads_whole_lines_only(tmp_path):
    """The job may be half-way through writing its summary line when the log is read."""
    from slurm_ext.commands.profile import _follow

    log = tmp_path / "job.out"
    log.write_text('profile: calibration kernels 17 in 24 s\nprofile: done {"profile_id": 3, "lay')
    ended = SimpleNamespace(job=lambda job_id: None)
    assert _follow(ended, 5, log, quiet=True) == ("UNKNOWN", None)
    log.write_text(log.read_text() + 'ers": 520}\n')
    assert _follow(ended, 5, log, quiet=True) == ("UNKNOWN", {"profile_id": 3, "layers": 520})


def test_a_store_that_cannot_be_made_is_one_clear_error(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(SpecError, match="is not a directory"):
        connect(afile / "store.sqlite", create=True)
    locked = tmp_path / "ro"
    locked.mkdir()
    (locked / "store.sqlite").mkdir()  # a directory where the file should be
    with pytest.raises(SpecError, match="cannot open"):
        connect(locked / "store.sqlite", create=True)


@pytest.mark.parametrize("corruption", [
    "UPDATE collectives SET seconds = -1",  # a negative time won every comparison
    "UPDATE collectives SET bytes = 0",
    "UPDATE collectives SET replica_groups = '[[0, 1]'",  # a SyntaxError traceback
    "UPDATE collectives SET gpus_per_node = 0",  # ZeroDivisionError
    "UPDATE layers SET forward_s = -0.3, forward_backward_s = -1.0",
    "UPDATE layers SET forward_backward_s = 'nan'",
    "UPDATE efficiency SET params_json = '{\"matmul_frac\": 0.5}'",  # TypeError
    "UPDATE efficiency SET params_json = 'oops'",  # JSONDecodeError
    "UPDATE efficiency SET params_json = json_set(params_json, '$.matmul_frac', 0)",  # ZeroDivisionError
    "DELETE FROM profiles",  # rows of a profile that is gone: KeyError
])
def test_unusable_rows_of_a_store_are_skipped_with_a_warning(tmp_path, corruption, caplog):
    db, _ = _profile(tmp_path)
    with connect(db) as conn:
        conn.execute(corruption)
    cluster, job = load_cluster("lab"), JobSpec("gpt-760m", 16, None, None)
    est = estimate_job(job, cluster, EstimateOptions(profile_db=str(db)), ("a10",))
    feasible = [e for e in est.cells if e.feasible]
    assert feasible and all(math.isfinite(e.iteration_time_s) and e.iteration_time_s > 0 for e in feasible)
    assert "rows skipped" in caplog.text


def test_the_daemons_profiled_pairs_read_the_store_again_only_when_it_changed(tmp_path, monkeypatch):
    """The daemon asks which (model, GPU type) pairs are profiled every round: the store is
    read once per version of the file, and again when a profile lands in it."""
    import estimator.profile_store as store
    from slurm_ext.profile_job import profiled_pairs
    db, _ = _profile(tmp_path, "a10")
    reads, real = [], store.load_profile_view
    monkeypatch.setattr(store, "load_profile_view", lambda path: reads.append(path) or real(path))
    for _ in range(3):
        assert profiled_pairs(str(db), {"gpt-760m", "gpt-1.3b"}) == {("gpt-760m", "a10")}
    assert len(reads) == 1
    _profile(tmp_path, "a100")  # a second profile lands in the same store
    assert profiled_pairs(str(db), {"gpt-760m"}) == {("gpt-760m", "a10"), ("gpt-760m", "a100")}
    assert len(reads) == 2
