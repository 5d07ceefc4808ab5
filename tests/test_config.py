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


def test_the_metrics_address_is_an_ip_address_and_is_where_it_listens(tmp_path):
    for word in ("localhost:9100", "yes", "[a]", "300.1.1.1"):
        with pytest.raises(ConfigError, match="metrics_address=.*give an IP address to listen on"):
            _load(tmp_path, f"metrics_address: {word}\n")
    assert _load(tmp_path, "").metrics_address == "0.0.0.0"
    config = _load(tmp_path, "metrics_address: 127.0.0.1\n")
    pytest.importorskip("prometheus_client")
    import socket
    from slurm_ext.metrics import Metrics
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert Metrics(port, config.metrics_address).enabled
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    # Linux routes all of 127/8 to the loopback: a server on every interface answers
    # 127.0.0.2 too, one on 127.0.0.1 alone does not.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=2).close()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert Metrics(port).enabled
    socket.create_connection(("127.0.0.2", port), timeout=2).close()


def test_background_profiling_without_a_store_to_write_is_refused(tmp_path):
    """It was on, and did nothing: no profile was ever submitted, and nothing said why."""
    with pytest.raises(ConfigError, match="background_profiling=True: .*slurm-ext.yaml.*needs profile_db"):
        _load(tmp_path, "background_profiling: true\n")
    assert _load(tmp_path, "background_profiling: true\nprofile_db: /srv/p.sqlite\n").background_profiling
