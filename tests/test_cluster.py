import pytest

from estimator.cluster import BUILTIN_CLUSTERS, cluster_from_dict, load_cluster
from estimator.errors import SpecError
from estimator.gpus import CATALOG, gpu_type


def test_catalog_has_the_required_types_with_datasheet_memory():
    assert {"a100", "v100", "a40", "a10", "h100", "l20", "h200"} <= set(CATALOG)
    assert gpu_type("A100").memory_gb == 40 and gpu_type("v100").memory_gb == 32
    assert gpu_type("h100").memory_gb == 80


def test_crius_1280():
    c = load_cluster("crius-1280")
    assert c.total_gpus() == 1280
    assert {t: c.total_gpus(t) for t in c.gpu_types} == {"a100": 320, "a40": 320, "a10": 320, "v100": 320}
    assert c.group("v100").gpus_per_node == 16


def test_lab_has_four_types():
    assert len(BUILTIN_CLUSTERS["lab"].gpu_types) >= 4


@pytest.mark.parametrize("raw, field", [
    ({"node_groups": []}, "name"),
    ({"name": "x"}, "node_groups"),
    ({"name": "x", "node_groups": [{"gpu_type": "tpu", "nodes": 1, "gpus_per_node": 1}]}, "node_groups[0].gpu_type"),
    ({"name": "x", "node_groups": [{"gpu_type": "a100", "nodes": 1, "gpus_per_node": 4},
                                   {"gpu_type": "a10", "nodes": -2, "gpus_per_node": 2}]}, "node_groups[1].nodes"),
    ({"name": "x", "node_groups": [{"gpu_type": "a100", "nodes": 1, "gpus_per_node": 4, "ram": 3}]}, "node_groups[0].ram"),
    ({"name": "x", "network": {"kind": "carrier-pigeon"},
      "node_groups": [{"gpu_type": "a100", "nodes": 1, "gpus_per_node": 4}]}, "network.kind"),
    # Two groups of one type in one partition: their nodes got the same names.
    ({"name": "x", "node_groups": [{"gpu_type": "a100", "nodes": 2, "gpus_per_node": 4},
                                   {"gpu_type": "a100", "nodes": 1, "gpus_per_node": 8}]}, "node_groups[1].partition"),
    # Misspelt keys and a bandwidth that is not a number were taken as the defaults or infinite.
    ({"name": "x", "network": {"kind": "infiniband", "bandwith_gbytes_s": 0.001},
      "node_groups": [{"gpu_type": "a100", "nodes": 1, "gpus_per_node": 4}]}, "network.bandwith_gbytes_s"),
    ({"name": "x", "netwrok": {"kind": "infiniband"},
      "node_groups": [{"gpu_type": "a100", "nodes": 1, "gpus_per_node": 4}]}, "netwrok"),
    ({"name": "x", "network": {"kind": "infiniband", "bandwidth_gbytes_s": float("nan")},
      "node_groups": [{"gpu_type": "a100", "nodes": 1, "gpus_per_node": 4}]}, "network.bandwidth_gbytes_s"),
    ({"name": "x", "network": {"kind": "infiniband", "bandwidth_gbytes_s": float("inf")},
      "node_groups": [{"gpu_type": "a100", "nodes": 1, "gpus_per_node": 4}]}, "network.bandwidth_gbytes_s"),
])
def test_yaml_errors_name_the_bad_field(raw, field):
    with pytest.raises(SpecError) as e:
        cluster_from_dict(raw)
    assert e.value.field == field


def test_load_from_yaml_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("name: mine\nnode_groups:\n  - {gpu_type: h100, nodes: 2, gpus_per_node: 8}\n")
    c = load_cluster(str(f))
    assert c.name == "mine" and c.total_gpus("h100") == 16
    with pytest.raises(SpecError):
        load_cluster(str(tmp_path / "missing.yaml"))


def test_network_bandwidth_is_in_gigabytes_per_second_under_either_key_name(caplog):
    group = {"gpu_type": "a100", "nodes": 1, "gpus_per_node": 4}
    new = cluster_from_dict({"name": "x", "network": {"kind": "infiniband", "bandwidth_gbytes_s": 12.5},
                             "node_groups": [group]})
    with caplog.at_level("WARNING", logger="estimator.cluster"):
        old = cluster_from_dict({"name": "x", "network": {"kind": "infiniband", "bandwidth_gbps": 12.5},
                                 "node_groups": [group]})
    assert "network.bandwidth_gbps is deprecated" in caplog.text and "bandwidth_gbytes_s" in caplog.text
    assert new.group("a100").network.bandwidth_gbytes_s == old.group("a100").network.bandwidth_gbytes_s == 12.5
    default = cluster_from_dict({"name": "x", "network": {"kind": "infiniband"}, "node_groups": [group]})
    assert default.group("a100").network.bandwidth_gbytes_s == 25.0
    with pytest.raises(SpecError) as e:
        cluster_from_dict({"name": "x", "network": {"bandwidth_gbytes_s": -1}, "node_groups": [group]})
    assert e.value.field == "network.bandwidth_gbytes_s"


def test_a_type_in_two_node_sizes_gets_the_layouts_each_allows():
    """a100 on one node of 4 and two of 8: 16 GPUs fit only as 2 nodes of 8; 8 GPUs as
    one node of 8 or two of 4 (each estimated on its own group's network)."""
    from estimator.estimate import enumerate_cells
    from estimator.jobs import JobSpec
    cluster = cluster_from_dict({"name": "two-sizes", "node_groups": [
        {"gpu_type": "a100", "nodes": 1, "gpus_per_node": 4},
        {"gpu_type": "a100", "nodes": 2, "gpus_per_node": 8, "partition": "a100-8",
         "network": {"kind": "infiniband"}}]})
    layouts = {(c.num_gpus, c.gpus_per_node) for c in enumerate_cells(JobSpec("gpt-760m", 64, num_gpus=8), cluster)}
    assert layouts == {(4, 4), (8, 4), (8, 8), (16, 8)}
    assert cluster.group("a100", 8).network.kind == "infiniband" and cluster.group("a100", 4).partition == "a100"
    assert cluster.group("a100", 2) == cluster.group("a100")  # a part of a node: the first group


def test_a_cell_laid_out_for_its_nodes_is_costed_on_their_group():
    """8 GPUs laid out 2 x 4 exist only because of the 6-GPU nodes: their group (and its
    network) is the one the estimate uses, not the first a100 group (8-GPU nodes)."""
    from estimator.cluster import cluster_from_dict
    cluster = cluster_from_dict({"name": "mixed", "node_groups": [
        {"gpu_type": "a100", "nodes": 2, "gpus_per_node": 8, "partition": "a100-8",
         "network": {"kind": "infiniband", "bandwidth_gbytes_s": 50}},
        {"gpu_type": "a100", "nodes": 2, "gpus_per_node": 6, "partition": "a100-6",
         "network": {"kind": "default", "bandwidth_gbytes_s": 1}}]})
    assert cluster.group("a100", 4, 8).gpus_per_node == 6
    assert cluster.group("a100", 8, 8).gpus_per_node == 8 and cluster.group("a100", 4).gpus_per_node == 8
    assert cluster.holds_layout("a100", 8, 4) and not cluster.holds_layout("a100", 32, 8)


def test_a_file_that_is_no_mapping_is_named_not_quoted_whole(tmp_path):
    text = tmp_path / "passwd"
    text.write_text("root:x:0:0:root:/root:/bin/bash " * 500)
    with pytest.raises(SpecError) as e:
        load_cluster(str(text))
    assert str(text) in str(e.value) and len(str(e.value)) < 300
    assert len(str(SpecError("field", "x" * 10_000, "hint"))) < 300  # any long value is cut
