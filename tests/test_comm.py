import re

import pytest

from estimator.comm import (COLUMNS, CommTable, CurveKey, collective_time, load_comm_table, model_time)
from estimator.errors import SpecError


@pytest.fixture(scope="module")
def table():
    return load_comm_table()


def test_measured_points_are_returned_exactly(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text(
        "gpu_type,num_nodes,gpus_per_node,network,op,replica_groups,group_size,num_elements,dtype,bytes,seconds\n"
        'a100,1,4,default,all-reduce,"[[0,1,2,3]]",4,1,float32,1000,0.001\n'
        'a100,1,4,default,all-reduce,"[[0,1,2,3]]",4,1,float32,100000,0.01\n'
        'a100,2,2,default,all-reduce,"[[0,2],[1,3]]",2,1,float32,1000,0.5\n')
    t = load_comm_table(str(f))
    assert collective_time(t, "all-reduce", 4, 1, 1000, "a100", "default", 1.0).seconds == pytest.approx(0.001)
    assert collective_time(t, "all-reduce", 4, 1, 100000, "a100", "default", 1.0).seconds == pytest.approx(0.01)
    # Log-log interpolation halfway between the two points (geometric means).
    mid = collective_time(t, "all-reduce", 4, 1, 10000, "a100", "default", 1.0)
    assert mid.seconds == pytest.approx(0.00316, rel=0.01) and mid.source == "table"
    # The cross-node pair is its own curve (span 2), not the intra-node one.
    assert collective_time(t, "all-reduce", 2, 2, 1000, "a100", "default", 1.0).seconds == pytest.approx(0.5)


def test_shipped_table_covers_the_measured_gpu_types(table):
    assert {"a100", "v100", "a40", "a10"} <= set(table.gpu_types)


def test_time_grows_with_bytes_and_crossing_nodes_is_slower(table):
    small = collective_time(table, "all-reduce", 4, 1, 1e6, "a100", "default", 1.25).seconds
    large = collective_time(table, "all-reduce", 4, 1, 1e9, "a100", "default", 1.25).seconds
    cross = collective_time(table, "all-reduce", 8, 2, 1e9, "a100", "default", 1.25).seconds
    assert small < large < cross


def test_unprofiled_type_uses_the_latency_bandwidth_model(table):
    t = collective_time(table, "all-reduce", 8, 1, 1e9, "h100", "default", 25.0)
    assert t.source == "model"
    # Ring all-reduce: 2·7/8 of the buffer over 450 GB/s NVLink, plus latency.
    assert t.seconds == pytest.approx(2 * 7 / 8 * 1e9 / 450e9, rel=0.05)
    assert t.seconds == pytest.approx(model_time("all-reduce", 8, 1, 1e9, "h100", 25.0))


def test_the_shipped_curves_across_nodes_hold_only_on_the_network_they_were_measured_on(table, tmp_path):
    """a100's curves were measured on the artifact's `default` network: a cluster on
    another kind gets its own bandwidth across nodes (the model), and the same curves
    within a node. A site's own table is its own network, whatever its column says."""
    args = ("all-reduce", 8, 2, 1e9, "a100")
    assert collective_time(table, *args, "default", 25.0).source == "table"
    slow, fast = (collective_time(table, *args, "infiniband", bw) for bw in (0.5, 400.0))
    assert slow.source == fast.source == "model" and slow.seconds > 50 * fast.seconds
    within = ("all-reduce", 4, 1, 1e9, "a100")
    assert collective_time(table, *within, "infiniband", 25.0) == collective_time(table, *within, "default", 25.0)
    assert collective_time(table, *within, "infiniband", 25.0).source == "table"
    assert collective_time(table, "all-reduce", 4, 2, 1e9, "a40", "infiniband", 25.0).source == "table"
    f = tmp_path / "site.csv"
    f.write_text("gpu_type,num_nodes,gpus_per_node,network,op,replica_groups,group_size,bytes,seconds\n"
                 'a100,2,4,default,all-reduce,"[[0,1,2,3,4,5,6,7]]",8,1000000000,0.2\n')
    site = load_comm_table(str(f))
    assert collective_time(site, *args, "infiniband", 0.5).seconds == pytest.approx(0.2)


def test_errors(table):
    with pytest.raises(SpecError):
        collective_time(table, "broadcast", 2, 1, 1, "a100", "default", 1.0)
    with pytest.raises(SpecError):
        load_comm_table("/nonexistent/table.csv")
    assert collective_time(table, "all-reduce", 1, 1, 1e9, "a100", "default", 1.0).seconds == 0.0
    assert isinstance(table, CommTable) and table.curve(CurveKey("x", "y", "send", 2, 1)) is None


def test_a_table_that_is_not_text_is_one_clear_error(tmp_path):
    binary = tmp_path / "table.csv"
    binary.write_bytes(b"\xff\xfejob_id\n")  # UTF-16, or anything not UTF-8: was a traceback
    with pytest.raises(SpecError, match="comm_table=.*not UTF-8 text"):
        load_comm_table(str(binary))
    header = tmp_path / "header.csv"
    header.write_text(",".join(COLUMNS) + "\n")  # nothing measured: every Cell on the model, silently
    with pytest.raises(SpecError, match="comm_table=.*no measured collective in it"):
        load_comm_table(str(header))


@pytest.mark.parametrize("row, says", [
    ('a100,1,4,default,all-reduce,"[[0,1,2,3]]",4,1,float32,1000,-1', "line 3: seconds='-1'"),
    ('a100,1,4,default,all-reduce,"[[0,1,2,3]]",4,1,float32,1000,abc', "line 3: seconds='abc'"),
    ('a100,1,4,default,all-reduce,"[[0,1,2,3]]",4,1,float32,nan,0.1', "line 3: bytes='nan'"),
    ('a100,1,x,default,all-reduce,"[[0,1,2,3]]",4,1,float32,1000,0.1', "line 3: gpus_per_node='x'"),
    ('a100,1,4,default,all-reduce', "line 3: 5 fields"),
    ('a100,1,4,default,all-reduce,foo,4,1,float32,1000,0.1', "line 3: replica_groups='foo'"),
    ('a100,1,4,default,all-reduce,"[]",4,1,float32,1000,0.1', "line 3: replica_groups='[]'"),
    ('a100,1,4,default,all-reduce,"[[0,1],[2,",4,1,float32,1000,0.1', "line 3: replica_groups='[[0,1],[2,'"),
    ('a100,1,4,default,all-reduce,5,4,1,float32,1000,0.1', "line 3: replica_groups='5'"),
])
def test_a_site_table_with_a_bad_row_is_refused_with_its_line(tmp_path, row, says):
    """A negative time would make every Cell that crosses it the fastest; a malformed one
    was a traceback."""
    f = tmp_path / "bad.csv"
    f.write_text("gpu_type,num_nodes,gpus_per_node,network,op,replica_groups,group_size,num_elements,dtype,"
                 'bytes,seconds\na100,1,4,default,all-reduce,"[[0,1,2,3]]",4,1,float32,1000,0.001\n' + row + "\n")
    with pytest.raises(SpecError, match=re.escape(says)):
        load_comm_table(str(f))


def test_past_the_largest_message_time_grows_at_the_curves_bandwidth(tmp_path):
    # A bandwidth-bound curve (1 GB/s) with a few % of jitter at its end: the last two
    # points alone give a slope of 0 (a flat time for any larger buffer) on one curve
    # and 3× the curve's rate on the other.
    head = ("gpu_type,num_nodes,gpus_per_node,network,op,replica_groups,group_size,"
            "num_elements,dtype,bytes,seconds\n")
    lines = []
    for gpu, last_s in (("flat", 1.00), ("steep", 1.03)):
        sizes = [2.5e8 + k * 2.5e7 for k in range(29)] + [9.9e8, 1.0e9]
        times = [x / 1e9 for x in sizes[:-2]] + [1.00, last_s]
        lines += [f'{gpu},2,2,default,all-reduce,"[[0,1,2,3]]",4,1,float32,{x:.0f},{t}\n'
                  for x, t in zip(sizes, times)]
    f = tmp_path / "t.csv"
    f.write_text(head + "".join(lines))
    t = load_comm_table(str(f))
    for gpu in ("flat", "steep"):
        five_gb = collective_time(t, "all-reduce", 4, 2, 5e9, gpu, "default", 1.0).seconds
        assert five_gb == pytest.approx(5.0, rel=0.05)


def test_groups_sharing_a_nodes_network_read_their_own_curve(tmp_path):
    # Two layouts of 2-GPU groups across 2 nodes: one group per node pair (fast) and two
    # groups whose members share each node's network (slow). They are separate curves,
    # not one curve of their medians.
    f = tmp_path / "t.csv"
    f.write_text(
        "gpu_type,num_nodes,gpus_per_node,network,op,replica_groups,group_size,num_elements,dtype,bytes,seconds\n"
        'a10,2,1,default,all-reduce,"[[0,1]]",2,1,float32,1000000,0.001\n'
        'a10,2,2,default,all-reduce,"[[0,2],[1,3]]",2,1,float32,1000000,0.004\n')
    t = load_comm_table(str(f))

    def seconds(groups_per_node):
        return collective_time(t, "all-reduce", 2, 2, 1e6, "a10", "default", 1.0, groups_per_node).seconds

    assert seconds(1) == pytest.approx(0.001)
    assert seconds(2) == pytest.approx(0.004)
    assert seconds(4) == pytest.approx(0.004)  # the nearest measured sharing


def test_a_stages_data_parallel_groups_share_a_node_per_tensor_parallel_rank():
    from estimator.cells import StagePlan
    from estimator.stage_comm import dp_groups_per_node
    assert dp_groups_per_node(StagePlan(0, 4, 4, 1), 2) == 1
    assert dp_groups_per_node(StagePlan(0, 4, 2, 2), 2) == 2
    assert dp_groups_per_node(StagePlan(0, 4, 2, 4), 2) == 2  # tp across nodes: each node's 2 GPUs
    assert dp_groups_per_node(StagePlan(0, 4, 2, 4), 8) == 4


def test_the_model_shares_a_nodes_network_among_the_groups_that_cross_it(table):
    # h100 has no curves: 8 data-parallel groups (one per tp rank) crossing two nodes at
    # once each get an eighth of the node's link.
    one = collective_time(table, "all-reduce", 2, 2, 1e9, "h100", "infiniband", 25.0, 1)
    eight = collective_time(table, "all-reduce", 2, 2, 1e9, "h100", "infiniband", 25.0, 8)
    assert one.source == eight.source == "model"
    assert eight.seconds == pytest.approx(8 * one.seconds, rel=0.01)


def test_a_layout_past_the_table_costs_what_the_table_attains_on_its_network(table):
    """32 A100s over 8 nodes (the table's curves span at most a few): the model runs at
    the bandwidth per node the type's curves across nodes attain on that network, not at
    the cluster's nominal 25 GB/s; on a network the table was not measured on, the nominal."""
    attained = table.inter_node_gbytes_s("a100", "default")
    assert 5.0 < attained < 25.0  # the artifact's A100 cluster, measured
    nbytes = 1e9
    past = collective_time(table, "all-reduce", 32, 8, nbytes, "a100", "default", 25.0)
    assert past.source == "model"
    assert past.seconds == pytest.approx(model_time("all-reduce", 32, 8, nbytes, "a100", attained))
    assert past.seconds > 1.5 * model_time("all-reduce", 32, 8, nbytes, "a100", 25.0)
    # The model at that bandwidth is near the table's own 2-node curve of 8 GPUs.
    measured = collective_time(table, "all-reduce", 8, 2, nbytes, "a100", "default", 25.0)
    assert measured.source == "table"
    assert 0.5 < model_time("all-reduce", 8, 2, nbytes, "a100", attained) / measured.seconds < 2.0
    other = collective_time(table, "all-reduce", 32, 8, nbytes, "a100", "infiniband", 25.0)
    assert other.seconds == pytest.approx(model_time("all-reduce", 32, 8, nbytes, "a100", 25.0))


def test_the_runners_pipeline_sends_count_every_device_of_the_stage():
    """The runner sends a stage's activations from each of its devices (every tp rank its
    copy): dp1tp4 puts four times dp4tp1's bytes through a node's NIC; Alpa sends one per
    replica."""
    from types import SimpleNamespace

    from estimator.cells import StagePlan
    from estimator.cluster import Network
    from estimator.stage_comm import stage_send_s

    def send_s(program, dp, tp):
        ctx = SimpleNamespace(table=load_comm_table(), cell=SimpleNamespace(
            gpu_type="a100", gpus_per_node=4, num_gpus=8, num_stages=2), group=SimpleNamespace(
            network=Network("default", 25.0)), eff=SimpleNamespace(inter_node_frac=1.0),
            options=SimpleNamespace(memory=SimpleNamespace(program=program)))
        output = SimpleNamespace(output_bytes=1e6)
        return stage_send_s(ctx, 0, [output], StagePlan(0, 1, dp, tp), 0, 64 / dp, set())

    runner = [send_s("runner", dp, tp) for dp, tp in ((4, 1), (2, 2), (1, 4))]
    assert runner[1] == pytest.approx(2 * runner[0], rel=0.05) and runner[2] == pytest.approx(4 * runner[0], rel=0.05)
    alpa = [send_s("alpa", dp, tp) for dp, tp in ((4, 1), (1, 4))]
    assert alpa[1] == pytest.approx(alpa[0], rel=0.05)
