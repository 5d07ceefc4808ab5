import pytest

from estimator.cluster import load_cluster
from estimator.errors import SpecError
from estimator.estimate import estimate_job
from estimator.jobs import JobSpec
from estimator.refine import MEASURED, REFINED, Measurement, refine


@pytest.fixture(scope="module")
def estimates():
    return estimate_job(JobSpec("gpt-1.3b", 256, num_gpus=8), load_cluster("crius-1280")).cells


def test_measured_cell_takes_the_measurement_and_its_type_is_rescaled(estimates):
    target = next(e for e in estimates if e.feasible and e.cell.gpu_type == "a100" and e.cell.num_gpus == 8)
    m = Measurement(target.cell.label(), target.iteration_time_s * 1.5, 10)
    out = refine(estimates, m, 256)
    assert len(out) == len(estimates)
    for before, after in zip(estimates, out):
        if before is target:
            assert after.iteration_time_s == pytest.approx(m.iteration_time_s)
            assert after.samples_per_s == pytest.approx(256 / m.iteration_time_s)
            assert after.fidelity == MEASURED
        elif before.feasible and before.cell.gpu_type == "a100":
            assert after.iteration_time_s == pytest.approx(1.5 * before.iteration_time_s)
            assert after.fidelity == REFINED
        else:
            assert after is before


def test_unknown_cell_changes_nothing(estimates):
    assert refine(estimates, Measurement("h100x8:s1", 1.0, 5), 256) is estimates


@pytest.mark.parametrize("raw", [[], {"cell": "a100", "iteration_time_s": 1, "steps_measured": 1},
                                 {"cell": "a100x8:s1", "iteration_time_s": -1, "steps_measured": 1},
                                 {"cell": "a100x8:s1", "iteration_time_s": 1.0, "steps_measured": 0}])
def test_bad_measurement_files_are_rejected(raw):
    with pytest.raises(SpecError):
        Measurement.from_json(raw)


def test_runner_format_parses():
    m = Measurement.from_json({"cell": "a100x8:s2", "plan": "cell=a100x8:s2 plan=[dp4tp1|dp4tp1] mb=8 remat=1",
                               "iteration_time_s": 2.5, "steps_measured": 16, "platform": "gpu"})
    assert m == Measurement("a100x8:s2", 2.5, 16)


def test_measured_peak_memory_replaces_the_estimate_of_the_measured_cell_only(estimates):
    """Time and memory separately: a GPU runner's peak memory becomes the measured Cell's
    (``memory_fidelity: measured``); other Cells keep their memory estimates."""
    target = next(e for e in estimates if e.feasible and e.cell.gpu_type == "a100" and e.cell.num_gpus == 8)
    m = Measurement.from_json({"cell": target.cell.label(), "iteration_time_s": target.iteration_time_s,
                               "steps_measured": 8, "peak_memory_gb": 31.5})
    assert m.peak_memory_gb == 31.5
    out = refine(estimates, m, 256)
    for before, after in zip(estimates, out):
        if before is target:
            assert (after.peak_memory_gb, after.memory_fidelity) == (31.5, MEASURED)
        else:
            assert (after.peak_memory_gb, after.memory_fidelity) == (before.peak_memory_gb, before.memory_fidelity)
    cpu = refine(estimates, Measurement(target.cell.label(), 1.0, 8), 256)  # no memory measured (CPU)
    assert next(a for b, a in zip(estimates, cpu) if b is target).memory_fidelity == target.memory_fidelity
