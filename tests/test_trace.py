"""The trace → job mapping follows MODELS.md §5: probabilities, caps, rejection, iterations."""

import random
from collections import Counter
from pathlib import Path

import pytest

from estimator.errors import SpecError
from estimator.gpus import CATALOG
from policy.measured import load_measured
from policy.trace import (BATCH_THRESHOLDS, FAMILIES, FAMILY_THRESHOLDS, GPU_COUNT_THRESHOLDS, GPU_COUNTS,
                          GPU_TYPE_THRESHOLDS, GPU_TYPES, MAX_ITER_TIME_S, SIM_ITER_DIVISOR, SIZE_THRESHOLDS,
                          TRACE_KINDS, TraceRecord, draw_request, map_trace, offered_load, read_trace,
                          trace_kind_for)

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "traces"
N_DRAWS = 40_000


def _probs(thresholds, limit=None):
    limit = limit or thresholds[-1]
    out, prev = [], 0
    for t in thresholds:
        out.append(max(0, min(t, limit) - prev) / limit)
        prev = min(t, limit)
    return out


@pytest.fixture(scope="module")
def draws():
    rng = random.Random(1234)
    return [draw_request(rng) for _ in range(N_DRAWS)]


@pytest.fixture(scope="module")
def table():
    return load_measured()


def _close(counts: Counter, keys, expected, n):
    for key, p in zip(keys, expected):
        assert counts[key] / n == pytest.approx(p, abs=0.012), (key, counts[key] / n, p)


def test_model_family_batch_and_type_follow_the_thresholds(draws):
    _close(Counter(d[0] for d in draws), FAMILIES, _probs(FAMILY_THRESHOLDS), N_DRAWS)
    _close(Counter(d[1] for d in draws), range(6), _probs(SIZE_THRESHOLDS), N_DRAWS)
    _close(Counter(d[4] for d in draws), GPU_TYPES, _probs(GPU_TYPE_THRESHOLDS), N_DRAWS)
    gpt = [d for d in draws if d[0] == "gpt"]
    _close(Counter(d[2] for d in gpt), (128, 256, 512), _probs(BATCH_THRESHOLDS), len(gpt))


@pytest.mark.parametrize("size_index", range(6))
def test_gpu_count_is_capped_by_the_size_index(draws, size_index):
    sub = [d for d in draws if d[1] == size_index]
    limit = GPU_COUNT_THRESHOLDS[min(4, size_index + 2)]
    expected = _probs(GPU_COUNT_THRESHOLDS, limit)
    counts = Counter(d[3] for d in sub)
    for n, p in zip(GPU_COUNTS, expected):
        if p == 0:
            assert counts[n] == 0
        else:
            assert counts[n] / len(sub) == pytest.approx(p, abs=0.03)


def test_size_index_zero_draws_at_most_four_gpus(draws):
    assert max(d[3] for d in draws if d[1] == 0) == 4
    assert {d[3] for d in draws if d[1] == 0} == {1, 2, 4}


def _records(n, duration_s=7200.0, start_s=0.0, step_s=60.0):
    return tuple(TraceRecord(f"job{i}", start_s + i * step_s, duration_s, 1) for i in range(n))


def test_accepted_jobs_are_measured_at_their_requested_allocation(table):
    jobs = map_trace(_records(300), table, seed=3)
    for j in jobs:
        size = CATALOG[j.spec.gpu_type].gpus_per_node
        t = table.best_locality_iter_time_s(j.spec.model, j.spec.global_batch, j.spec.gpu_type,
                                            j.spec.num_gpus, size)
        assert t is not None and t <= MAX_ITER_TIME_S and t == j.requested_iter_time_s
        assert not j.spec.model.endswith(("39b", "70b", "13b"))  # menu-only sizes are rejected


def test_philly_iterations_come_from_the_recorded_duration(table):
    jobs = map_trace(_records(50, duration_s=36_000.0), table, seed=1)
    for j in jobs:
        assert j.iterations == max(1, int(36_000.0 // j.requested_iter_time_s))


def test_helios_iterations_are_bounded_then_divided(table):
    jobs = map_trace(_records(200, duration_s=10.0), table, seed=1, kind=TRACE_KINDS["helios"])
    low, high = TRACE_KINDS["helios"].iteration_bounds
    assert all(low // SIM_ITER_DIVISOR <= j.iterations <= high // SIM_ITER_DIVISOR for j in jobs)
    assert len({j.iterations for j in jobs}) > 20  # redrawn uniformly, not clamped


def test_same_seed_same_jobs_other_seed_other_jobs(table):
    recs = _records(100)
    assert map_trace(recs, table, seed=7) == map_trace(recs, table, seed=7)
    assert map_trace(recs, table, seed=7) != map_trace(recs, table, seed=8)


def test_density_subsamples_without_changing_the_kept_jobs(table):
    recs = _records(400)
    full = {j.job_id: j for j in map_trace(recs, table, seed=2)}
    half = map_trace(recs, table, seed=2, density=0.5)
    assert 140 < len(half) < 260
    offset = full[half[0].job_id].submit_time_s
    for j in half:
        assert j.spec == full[j.job_id].spec and j.iterations == full[j.job_id].iterations
        assert j.submit_time_s == pytest.approx(full[j.job_id].submit_time_s - offset)
    with pytest.raises(SpecError, match="density"):
        map_trace(recs, table, density=0.0)


def test_itp_submit_filter_and_time_shift(table):
    kind = trace_kind_for("itp_cluster08.csv")
    assert kind.min_submit_s == 1_945_572
    recs = _records(10, start_s=kind.min_submit_s - 300, step_s=100)
    jobs = map_trace(recs, table, seed=0, kind=kind)
    assert len(jobs) == 7 and jobs[0].submit_time_s == 0.0
    assert trace_kind_for("philly_2week.csv").min_submit_s == 0


def test_offered_load_is_asked_gpu_hours_over_capacity(table):
    jobs = map_trace(_records(20, step_s=3600), table, seed=0)
    asked = sum(j.iterations * j.requested_iter_time_s * j.spec.num_gpus for j in jobs)
    window = jobs[-1].submit_time_s - jobs[0].submit_time_s
    assert offered_load(jobs, 100) == pytest.approx(asked / (100 * window))


HEADER = "job_id,submit_time_s,duration_s,num_gpus"


@pytest.mark.parametrize("text, error", [
    ("job_id,submit_time_s\n1,2\n", "missing column"),
    ("job_id,submit_time_s,duration_s,num_gpus,gpu_type,status\n1,x,3,1,,\n", "line 2"),
    # A second row with a job's id would replace the first job in a replay.
    (f"{HEADER}\nj1,0,100,1\nj2,5,100,1\nj1,10,100,2\n", "line 4.*already given on line 2"),
    # Ids that differ only in spaces are one job; an empty id is none.
    (f"{HEADER}\nj1,0,100,1\n j1 ,5,100,1\n", "line 3.*already given on line 2"),
    (f"{HEADER}\n,0,100,1\n", "line 2.*job_id is empty"),
    # 1e30 s became 8e28 iterations, a job that never ends.
    (f"{HEADER}\nj1,0,1e30,1\n", "line 2.*ten years"),
])
def test_read_trace_errors_quote_the_file(tmp_path, text, error):
    bad = tmp_path / "bad.csv"
    bad.write_text(text)
    with pytest.raises(SpecError, match=error):
        read_trace(bad)


def test_a_csv_saved_with_a_byte_order_mark_reads_as_without(tmp_path):
    """Spreadsheets save "CSV UTF-8" with a BOM before the first column's name."""
    text = "job_id,submit_time_s,duration_s,num_gpus\nj1,0,100,1\n"
    plain, marked = tmp_path / "plain.csv", tmp_path / "marked.csv"
    plain.write_text(text)
    marked.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert read_trace(marked) == read_trace(plain)
    assert len(read_trace(marked)) == 1


@pytest.mark.skipif(not (TRACES / "pai_1day_synthetic_sizes.csv").exists(), reason="shared trace data absent")
def test_real_trace_maps_every_record(table):
    recs = read_trace(TRACES / "pai_1day_synthetic_sizes.csv")
    jobs = map_trace(recs, table, seed=0, kind=trace_kind_for("pai_1day_synthetic_sizes.csv"))
    assert len(jobs) == len(recs)
    assert [j.submit_time_s for j in jobs] == sorted(j.submit_time_s for j in jobs)


def test_a_record_of_no_duration_or_no_gpu_is_an_arrival_not_an_error(tmp_path, table):
    """One zero-duration record ended the whole replay with an error; the mapping draws its
    own GPU count and gives every job at least one iteration. A negative duration is still
    refused."""
    trace = tmp_path / "t.csv"
    trace.write_text("job_id,submit_time_s,duration_s,num_gpus\nj1,100,0,4\nj2,200,50,0\nj3,300,60,1\n")
    jobs = map_trace(read_trace(trace), table, seed=0)
    assert [j.job_id for j in jobs] == ["j1", "j2", "j3"] and all(j.iterations >= 1 for j in jobs)
    # Its deadline leaves time for the iteration it was given (it was its submit time).
    assert all(j.deadline_s >= j.submit_time_s + j.iterations * j.requested_iter_time_s for j in jobs)
    bad = tmp_path / "bad.csv"
    bad.write_text("job_id,submit_time_s,duration_s,num_gpus\nj1,100,-1,4\n")
    with pytest.raises(SpecError, match="line 2"):
        read_trace(bad)
