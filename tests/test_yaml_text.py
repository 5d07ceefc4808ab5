"""A key given twice in a YAML file is an error, in every file slurm-ext reads: PyYAML
would keep the last one without a word."""

import pytest

from estimator.cluster import load_cluster
from estimator.errors import SpecError
from estimator.models import load_model
from estimator.yaml_text import load_yaml
from slurm_ext.config import ConfigError, read_yaml


def test_a_model_with_a_repeated_key_is_refused_with_its_line(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("hidden: 1024\nlayers: 2\nheads: 4\nsequence: 128\nvocab: 1000\nhidden: 2048\n")
    with pytest.raises(SpecError) as e:
        load_model(str(path))
    assert "the key 'hidden' is given twice (line 6, column 1)" in str(e.value)


def test_a_daemon_config_or_cluster_with_a_repeated_key_is_refused(tmp_path):
    config = tmp_path / "slurm-ext.yaml"
    config.write_text("policy: fcfs\ninterval_s: 30\npolicy: crius\n")
    with pytest.raises(ConfigError, match="'policy' is given twice"):
        read_yaml(config)
    cluster = tmp_path / "c.yaml"
    cluster.write_text("name: c\nnode_groups:\n  - {gpu_type: a100, nodes: 2, gpus_per_node: 4, nodes: 8}\n")
    with pytest.raises(SpecError, match="'nodes' is given twice"):
        load_cluster(str(cluster))


def test_nested_mappings_and_merge_keys_read_as_before():
    assert load_yaml("a: 1\nb: {c: 2}\nd: [1, {e: 3}]\n") == {"a": 1, "b": {"c": 2}, "d": [1, {"e": 3}]}
    assert load_yaml("base: &b {x: 1}\nother:\n  <<: *b\n  y: 2\n")["other"] == {"x": 1, "y": 2}
    assert load_yaml("") is None
