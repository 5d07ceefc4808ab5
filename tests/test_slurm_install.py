"""Which Slurm the project runs: the system's or one built into a prefix (no Slurm needed)."""

from pathlib import Path

import pytest

from estimator.cluster import load_cluster
from slurm_ext.backend import make_client
from slurm_ext.cli_backend import CliSlurmClient
from slurm_ext.config import ConfigError, resolve
from slurm_ext.lab import LabPaths, render_slurm_conf
from slurm_ext.slurm_install import SlurmInstall, install_from, install_from_env, parse_version


def test_system_slurm_runs_commands_by_name_and_daemons_from_sbin():
    system = SlurmInstall()
    assert system.command("squeue") == "squeue"
    assert system.command("slurmctld") == "/usr/sbin/slurmctld"
    assert system.argv(["scontrol", "ping"]) == ["scontrol", "ping"]
    assert system.env() == {}


def test_a_prefix_supplies_every_slurm_command_and_leads_path():
    built = install_from("/opt/slurm-25.11")
    assert built.command("squeue") == "/opt/slurm-25.11/bin/squeue"
    assert built.command("slurmd") == "/opt/slurm-25.11/sbin/slurmd"
    assert built.argv(["scancel", "--batch", "7"]) == ["/opt/slurm-25.11/bin/scancel", "--batch", "7"]
    # Other programs are left alone.
    assert built.command("munged") == "munged" and built.command("python3") == "python3"
    path = built.env({"PATH": "/usr/bin:/bin"})["PATH"]
    assert path == "/opt/slurm-25.11/bin:/opt/slurm-25.11/sbin:/usr/bin:/bin"
    assert built.include_dir == Path("/opt/slurm-25.11/include")


def test_prefix_from_the_environment():
    assert install_from_env({}).prefix is None
    assert install_from_env({"SLURM_EXT_SLURM_PREFIX": ""}).prefix is None
    assert install_from_env({"SLURM_EXT_SLURM_PREFIX": "/opt/x"}).prefix == Path("/opt/x")


def test_a_missing_prefix_names_what_is_missing(tmp_path):
    missing = install_from(tmp_path).missing()
    assert str(tmp_path / "sbin" / "slurmctld") in missing and str(tmp_path / "bin" / "sbatch") in missing


@pytest.mark.parametrize("text,version", [
    ("slurm 25.11.7\n", (25, 11, 7)),
    ("slurm-wlm 22.05.8\n", (22, 5, 8)),
    ("slurm 23.02\n", (23, 2, 0)),
    ("no version here", None),
])
def test_versions_read_from_version_output(text, version):
    assert parse_version(text) == version


def test_lab_config_names_the_none_plugins_only_for_22_05(tmp_path):
    cluster, paths = load_cluster("lab"), LabPaths(tmp_path)
    old = render_slurm_conf(cluster, paths, 17800, "host", (22, 5, 8))
    new = render_slurm_conf(cluster, paths, 17800, "host", (25, 11, 7))
    for line in ("TaskPlugin=task/none", "SwitchType=switch/none", "JobCompType=jobcomp/none",
                 "AccountingStorageType=accounting_storage/none"):
        assert line in old and line not in new
    # Everything else is the same config.
    assert {line for line in old.splitlines() if "none" not in line} == \
        {line for line in new.splitlines() if "none" not in line}


def test_backend_and_prefix_are_config_keys():
    cfg = resolve({}, {"SLURM_EXT_SLURM_BACKEND": "pyslurm", "SLURM_EXT_SLURM_PREFIX": "/opt/slurm-25.11"}, {})
    assert (cfg.slurm_backend, cfg.slurm_prefix) == ("pyslurm", "/opt/slurm-25.11")
    assert (resolve({}, {}, {}).slurm_backend, resolve({}, {}, {}).slurm_prefix) == ("cli", None)
    with pytest.raises(ConfigError, match="slurm_backend.*environment.*cli, pyslurm"):
        resolve({}, {"SLURM_EXT_SLURM_BACKEND": "rest"}, {})


def test_the_cli_backend_runs_the_prefix_commands():
    client = make_client("cli", "/opt/slurm-25.11")
    assert isinstance(client, CliSlurmClient)
    assert client.install.argv(["squeue"]) == ["/opt/slurm-25.11/bin/squeue"]
    with pytest.raises(ValueError, match="unknown Slurm backend"):
        make_client("rest")
