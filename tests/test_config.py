"""The daemon's configuration: what YAML reads as something else is refused in one line."""

import pytest

from slurm_ext.config import ConfigError, load_config


def _load(tmp_path, text):
    path = tmp_path / "slurm-ext.yaml"
    path.write_text(text)
    return load_config(str(path), {}, {})


@pytest.mark.parametrize("key", ["checkpoint_root", "profile_db", "slurm_prefix"])
def test_a_path_setting_is_a_path_or_null(tmp_path, key):
    for word in ("off", "no", "false", "[a]", "{a: 1}"):  # YAML: a boolean, a list, a mapping
        with pytest.raises(ConfigError, match=f"{key}=.*slurm-ext.yaml.*give a path, or null"):
            _load(tmp_path, f"{key}: {word}\n")
    assert getattr(_load(tmp_path, f"{key}: null\n"), key) is None
    assert getattr(_load(tmp_path, f"{key}: /srv/x\n"), key) == "/srv/x"


def test_a_partition_yaml_reads_as_a_boolean_must_be_quoted(tmp_path):
    with pytest.raises(ConfigError, match="partitions.True.*quote the partition name"):
        _load(tmp_path, "partitions: {yes: a100}\n")
    assert _load(tmp_path, "partitions: {'yes': a100}\n").partition_map() == {"yes": "a100"}


def test_an_unknown_policy_names_where_it_was_set(tmp_path):
    with pytest.raises(ConfigError, match=r"policy='nope': \(.*slurm-ext.yaml\) unknown policy; known: "):
        _load(tmp_path, "policy: nope\n")
