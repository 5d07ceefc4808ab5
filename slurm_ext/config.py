"""The daemon's configuration, resolved once into a frozen value.

Precedence: command-line flag > environment (``SLURM_EXT_<KEY>``) > YAML file > defaults.
Every key is documented in ``etc/slurm-ext.yaml``. :func:`resolve` is pure; only
:func:`read_yaml` touches the filesystem.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from slurm_ext.guarantees import GuaranteePolicy
from slurm_ext.profile_job import MIN_PROFILE_MINUTES
from estimator.cluster import NETWORK_DEFAULT_GBYTES_S, load_cluster
from estimator.errors import SpecError, yaml_problem
from estimator.yaml_text import load_yaml
from estimator.gpus import CATALOG

ENV_PREFIX = "SLURM_EXT_"
ENV_CONFIG = "SLURM_EXT_CONFIG"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
PLAN_SPACES = ("cell", "dp-only")
SLURM_BACKENDS = ("cli", "pyslurm")


class ConfigError(SpecError):
    """A configuration value is invalid; the message names the key and where it came from."""


@dataclass(frozen=True)
class DaemonConfig:
    """Everything the daemon reads from its configuration.

    Attributes:
        interval_s: seconds between scheduling rounds.
        poll_s: seconds between cheap checks for newly submitted elastic jobs; a new one
            starts a round early. 0 disables the check.
        policy: the registered policy name.
        policy_options: keyword configuration passed to the policy's constructor.
        partitions: partition → GPU type. Empty: derived from the nodes' typed GPUs
            (a partition whose nodes all carry one GPU type maps to it).
        cluster: a cluster spec (built-in name or YAML path) giving the estimator the
            network between nodes; None: derived from Slurm's nodes with ``network``.
        network: network kind for a derived cluster spec (``default``, ``infiniband``, ...).
        state_db: the SQLite state file.
        metrics_port: port of the Prometheus endpoint; None: no metrics.
        metrics_address: the address the endpoint listens on (``0.0.0.0``: every
            interface, for a Prometheus on another host; ``127.0.0.1``: this host only).
        rescale_timeout_s: how long a running job may take to checkpoint and requeue
            itself after USR1 before it is requeued by force.
        restart_cost_s: what one restart costs a job (checkpoint, requeue, resume, plan
            tuning), seconds; policies weigh a rescale against it.
        dry_run: print the actions instead of taking them.
        plan_space: estimator plan space for policies (``cell``; ``dp-only`` restricts
            plans to data parallelism).
        expert_parallel: MoE jobs' Cells may split their experts over all of a stage's
            GPUs (``estimator.estimate.EstimateOptions.expert_parallel``; the runner runs
            it with and without tensor parallelism), kept where faster.
        max_gpus: the largest GPU count offered to a job that names no count (one that
            asks for N GPUs is offered N/2, N and 2N).
        micro_batches: micro-batches per iteration for jobs whose global batch it
            divides (`micro_batches_for`); None: the estimator's default.
        log_level: DEBUG, INFO, WARNING or ERROR.
        slurm_timeout_s: time limit of each Slurm command.
        backoff_max_s: longest wait between retries while slurmctld does not answer.
        max_annotations_per_round: AdminComment-only updates (why a job waits) per round;
            bounds a round's Slurm calls when thousands of jobs wait.
        max_new_specs_per_round: new elastic jobs whose spec (batch script) is read per
            round, oldest first; the rest wait for the next round.
        checkpoint_root: the directory where elastic jobs keep their checkpoints (the
            runner's ``SLURM_EXT_CHECKPOINT_ROOT``); a running job's measured seconds per
            iteration (``ROOT/<job id>/measured.json``) then refine its Cells' estimates.
            None: no feedback.
        use_cpu_measurements: also trust speeds measured on CPU fake devices (lab, tests).
        profile_db: a profile store of `slurm-ext profile`: the GPU types it profiled are
            estimated from its measurements (``fidelity: profiled``). None: analytic only.
        background_profiling: with a ``profile_db``, profile an elastic job's built-in model
            on a GPU type that lacks it whenever a node of that type is idle, as a short,
            lowest-priority job cancelled the moment a user job needs the node
            (``slurm_ext.profile_job``).
        background_profile_time_min: the time limit of such a job.
        profile_mpi: srun's ``--mpi`` plugin for profiling jobs (``none`` leaves it out).
        steering: how a job reaches its Cell's GPU type (``slurm_ext.steering``): ``auto``
            (a job in a partition of one type moves to the type's partition; one in a mixed
            partition is retyped there by GRES on Slurm 23.02.6 and later, else steered by
            node features), or ``partition``, ``gres``, ``features`` for every job.
        refit_threshold_frac: online refit (Rubick; needs ``profile_db`` and
            ``checkpoint_root``): when a running job's measured seconds per iteration differ
            from the estimate of the plan it runs by more than this fraction, its GPU type's
            efficiency is refitted from every measurement of the type seen so far and, when
            that lowers the median error, written into the profile store (``slurm_ext.refit``).
        forecast_every_s: how often the daemon runs its policy forward to forecast each
            elastic job's start and end (``policy.forecast``), written into its AdminComment
            within the round's AdminComment budget; 0 turns forecasts off.
        forecast_max_decisions: policy decisions one forecast takes at most; beyond them
            the rest is a list schedule in the policy's order (``policy.forecast``).
        forecast_budget_s: wall time after which one forecast takes no further decision
            (the list schedule finishes it): what bounds its cost on a long queue.
        slurm_backend: how the daemon talks to Slurm: ``cli`` (the commands) or ``pyslurm``
            (Slurm 25.11's C API; the ``pyslurm`` extra).
        guarantees: who may ask for ``guaranteed=yes`` (`GuaranteePolicy`: users, accounts
            and QOS, each with a GPU quota); nobody by default, so the setting binds nothing
            until the admin lists someone.
        slurm_prefix: where the Slurm the daemon runs is installed (``/opt/slurm-25.11``
            from ``make slurm-25.11``); None: the system's, on PATH.
    """

    interval_s: float = 60.0
    poll_s: float = 2.0
    policy: str = "cells-ilp"
    policy_options: tuple[tuple[str, object], ...] = ()
    partitions: tuple[tuple[str, str], ...] = ()
    cluster: str | None = None
    network: str = "default"
    state_db: str = "/var/lib/slurm-ext/state.db"
    metrics_port: int | None = None
    metrics_address: str = "0.0.0.0"
    rescale_timeout_s: float = 120.0
    restart_cost_s: float = 60.0
    dry_run: bool = False
    plan_space: str = "cell"
    expert_parallel: bool = False
    max_gpus: int = 64
    micro_batches: int | None = None
    log_level: str = "INFO"
    slurm_timeout_s: float = 30.0
    backoff_max_s: float = 300.0
    max_annotations_per_round: int = 40
    max_new_specs_per_round: int = 50
    checkpoint_root: str | None = None
    use_cpu_measurements: bool = False
    profile_db: str | None = None
    background_profiling: bool = False
    background_profile_time_min: int = 10
    profile_mpi: str = "pmi2"
    steering: str = "auto"
    refit_threshold_frac: float = 0.10
    forecast_every_s: float = 60.0
    forecast_max_decisions: int = 60
    forecast_budget_s: float = 1.5
    slurm_backend: str = "cli"
    slurm_prefix: str | None = None
    guarantees: GuaranteePolicy = GuaranteePolicy()

    def partition_map(self) -> dict[str, str]:
        return dict(self.partitions)

    def micro_batches_for(self, global_batch: int) -> int | None:
        """``micro_batches`` where it divides the job's global batch, else None (the
        estimator's default, which divides every batch): a site-wide count must not make
        the jobs it does not divide fail as if their spec were wrong."""
        m = self.micro_batches
        return m if m is not None and global_batch % m == 0 else None


KEYS = tuple(f.name for f in fields(DaemonConfig))
# The least time a running job is given to checkpoint after USR1 (0 forced its requeue at
# the next round, with no checkpoint).
MIN_RESCALE_TIMEOUT_S = 10.0
_FLOATS = {"interval_s", "poll_s", "rescale_timeout_s", "restart_cost_s", "slurm_timeout_s", "backoff_max_s",
           "forecast_every_s", "forecast_budget_s", "refit_threshold_frac"}
_INTS = {"max_gpus", "max_annotations_per_round", "max_new_specs_per_round", "forecast_max_decisions",
         "background_profile_time_min"}
_OPTIONAL_INTS = {"metrics_port", "micro_batches"}


def read_yaml(path: str | Path) -> dict:
    """The mapping in a YAML config file (empty file: empty mapping)."""
    p = Path(path)
    try:
        raw = load_yaml(p.read_text())
    except OSError as e:
        raise ConfigError("config", str(path), f"cannot read: {e.strerror}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError("config", str(path), yaml_problem(e)) from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError("config", str(path), "the file must hold a mapping of key: value")
    return raw


def env_values(env: Mapping[str, str]) -> dict[str, str]:
    """``SLURM_EXT_<KEY>`` variables as config keys (``SLURM_EXT_INTERVAL_S`` → interval_s)."""
    out = {}
    for name, value in env.items():
        if name.startswith(ENV_PREFIX) and name != ENV_CONFIG:
            key = name[len(ENV_PREFIX):].lower()
            if key in KEYS:
                out[key] = value
    return out


def _bool(key: str, raw: object, source: str) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(key, raw, f"({source}) write true or false")


def _number(key: str, raw: object, source: str, kind: type, optional: bool,
            positive: bool = False) -> float | int | None:
    if optional and (raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "none", "null"))):
        return None
    if isinstance(raw, bool):
        raise ConfigError(key, raw, f"({source}) give a number")
    if kind is int and isinstance(raw, float) and not raw.is_integer():
        raise ConfigError(key, raw, f"({source}) give a whole number")  # int(2.7) would say 2
    try:
        value = kind(raw)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(key, raw, f"({source}) give a {'whole ' if kind is int else ''}number") from None
    if value < 0 or (kind is float and not math.isfinite(value)) or (positive and value == 0):
        raise ConfigError(key, raw, f"({source}) give a {'positive' if positive else 'non-negative'}, finite number")
    return value


def _partitions(raw: object, source: str) -> tuple[tuple[str, str], ...]:
    if raw is None or raw == "":
        return ()
    if isinstance(raw, str):  # environment form: "a100=a100,gpu-old=v100"
        pairs = []
        for item in raw.split(","):
            part, sep, gpu = item.partition("=")
            if not sep:
                raise ConfigError("partitions", raw, f"({source}) write partition=gpu_type,...")
            pairs.append((part.strip(), gpu.strip()))
        raw = dict(pairs)
    if not isinstance(raw, dict):
        raise ConfigError("partitions", raw, f"({source}) give a mapping partition: gpu_type")
    out = []
    for part, gpu in raw.items():
        if not isinstance(part, str):  # YAML reads a partition named yes or 2024 as a bool or number
            raise ConfigError(f"partitions.{part}", gpu, f"({source}) quote the partition name")
        gpu_name = str(gpu).strip().lower()
        if gpu_name not in CATALOG:
            raise ConfigError(f"partitions.{part}", gpu, f"({source}) unknown GPU type; use one of {', '.join(CATALOG)}")
        out.append((str(part), gpu_name))
    return tuple(sorted(out))


def _yaml_text(key: str, raw: object, source: str, example: str) -> object:
    """A mapping the environment gives as YAML text (``'{users: {alice: 16}}'``), parsed;
    any other value as it is."""
    if not isinstance(raw, str):
        return raw
    try:
        return load_yaml(raw)
    except yaml.YAMLError:
        raise ConfigError(key, raw, f"({source}) give a YAML mapping, e.g. '{example}'") from None


def _coerce(key: str, raw: object, source: str) -> object:
    if key in _FLOATS:
        value = _number(key, raw, source, float, False, positive=key in ("interval_s", "slurm_timeout_s"))
        if key == "rescale_timeout_s" and value < MIN_RESCALE_TIMEOUT_S:
            raise ConfigError(key, raw, f"({source}) give at least {MIN_RESCALE_TIMEOUT_S:.0f} s: a job needs "
                                        "that long to checkpoint before its requeue is forced")
        return value
    if key in _INTS:
        value = _number(key, raw, source, int, False)
        if key == "max_gpus" and value < 1:
            raise ConfigError(key, raw, f"({source}) give at least 1: with 0 no job has a Cell, and every "
                                        "elastic job runs as submitted")
        if key == "max_new_specs_per_round" and value < 1:
            raise ConfigError(key, raw, f"({source}) give at least 1: with 0 no elastic job's spec is ever "
                                        "read, and every elastic job stays held")
        if key == "background_profile_time_min" and value < MIN_PROFILE_MINUTES:
            raise ConfigError(key, raw, f"({source}) give at least {MIN_PROFILE_MINUTES} (minutes): a shorter "
                                        "profile has no time left to measure, and ends in its time limit")
        return value
    if key in _OPTIONAL_INTS:
        value = _number(key, raw, source, int, True)
        if key == "metrics_port" and value is not None and not 0 < value < 65536:
            raise ConfigError(key, raw, f"({source}) give a TCP port 1-65535 or null")
        if key == "micro_batches" and value == 0:
            raise ConfigError(key, raw, f"({source}) give a positive whole number, or null for the estimator's "
                                        "default")
        return value
    if key in ("dry_run", "use_cpu_measurements", "background_profiling", "expert_parallel"):
        return _bool(key, raw, source)
    if key == "partitions":
        return _partitions(raw, source)
    if key == "policy_options":
        raw = _yaml_text(key, raw, source, "{min_change_interval_s: 600}")
        if raw is None:
            return ()
        if not isinstance(raw, dict):
            raise ConfigError(key, raw, f"({source}) give a mapping of option: value")
        return tuple(sorted((str(k), v) for k, v in raw.items()))
    if key == "log_level":
        level = str(raw).strip().upper()
        if level not in LOG_LEVELS:
            raise ConfigError(key, raw, f"({source}) use one of {', '.join(LOG_LEVELS)}")
        return level
    if key == "plan_space":
        if raw not in PLAN_SPACES:
            raise ConfigError(key, raw, f"({source}) use one of {', '.join(PLAN_SPACES)}")
        return raw
    if key == "guarantees":
        raw = _yaml_text(key, raw, source, "{users: {alice: 16}}")
        if raw is None:
            return GuaranteePolicy()
        if not isinstance(raw, dict):
            raise ConfigError(key, raw, f"({source}) give a mapping of users/accounts/qos")
        try:
            return GuaranteePolicy.from_mapping(raw)
        except ValueError as e:
            raise ConfigError(key, raw, f"({source}) {e}") from None
    if key == "steering":
        from slurm_ext.steering import METHODS
        if raw not in METHODS:
            raise ConfigError(key, raw, f"({source}) use one of {', '.join(METHODS)}")
        return raw
    if key == "slurm_backend":
        if raw not in SLURM_BACKENDS:
            raise ConfigError(key, raw, f"({source}) use one of {', '.join(SLURM_BACKENDS)}")
        return raw
    if key == "cluster":
        if raw in (None, "", "none", "null"):
            return None
        try:  # every round reads it: a bad one is refused now, not in every round
            load_cluster(str(raw))
        except SpecError as e:
            raise ConfigError(key, raw, f"({source}) {e.hint if e.field == key else e}") from None
        return str(raw)
    if key in ("checkpoint_root", "slurm_prefix", "profile_db"):
        if raw in (None, "", "none", "null"):
            return None
        if not isinstance(raw, str):  # YAML's off/no/false are booleans, not a path named "False"
            raise ConfigError(key, raw, f"({source}) give a path, or null to leave it unset")
        return raw
    if key == "metrics_address":
        address = str(raw).strip() if isinstance(raw, str) else ""
        try:
            ipaddress.ip_address(address)
        except ValueError:
            raise ConfigError(key, raw, f"({source}) give an IP address to listen on (0.0.0.0: every interface, "
                                        "127.0.0.1: this host only)") from None
        return address
    if key == "network":
        kind = str(raw).strip().lower()
        if kind not in NETWORK_DEFAULT_GBYTES_S:
            raise ConfigError(key, raw, f"({source}) use one of {', '.join(NETWORK_DEFAULT_GBYTES_S)}")
        return kind
    if key in ("policy", "state_db", "profile_mpi"):
        if not isinstance(raw, str) or not raw.strip():
            raise ConfigError(key, raw, f"({source}) give a non-empty string")
        return raw.strip()
    raise ConfigError(key, raw, f"({source}) unknown key; known: {', '.join(KEYS)}")


def resolve(flags: Mapping[str, object] | None = None, env: Mapping[str, str] | None = None,
            file_values: Mapping[str, object] | None = None,
            file_name: str = "config file") -> DaemonConfig:
    """Merge the sources into one DaemonConfig (flag > environment > file > default).

    Args:
        flags: values given on the command line (None values are ignored).
        env: the process environment (only ``SLURM_EXT_*`` keys are read).
        file_values: the YAML file's mapping.
        file_name: the file's name, quoted in errors.

    Raises:
        ConfigError: an unknown key in the file or an invalid value anywhere, naming its source.
    """
    values: dict[str, object] = {}
    for key in (file_values or {}):
        if key not in KEYS:
            raise ConfigError(str(key), file_values[key], f"({file_name}) unknown key; known: {', '.join(KEYS)}")
    layers = [(file_name, dict(file_values or {})), ("environment", env_values(env or {})),
              ("command line", {k: v for k, v in (flags or {}).items() if v is not None})]
    sources: dict[str, str] = {}
    for source, layer in layers:
        for key, raw in layer.items():
            values[key], sources[key] = _coerce(key, raw, source), source
    config = DaemonConfig(**values)
    _check_policy(config, sources)
    if config.background_profiling and config.profile_db is None:
        raise ConfigError("background_profiling", True, f"({sources['background_profiling']}) needs profile_db: "
                                                        "the store the profiles are written to")
    return config


def _check_policy(config: DaemonConfig, sources: Mapping[str, str]) -> None:
    """The policy can be built with its options, each of the type it declares (a typo or
    a ``2.5`` for a count fails here, not in every round)."""
    from policy.registry import make_policy, policy_class

    policy_source = sources.get("policy", "defaults")
    source = sources.get("policy_options", policy_source)
    options = dict(config.policy_options)
    try:
        hints = _option_types(policy_class(config.policy))
    except SpecError as e:
        raise ConfigError("policy", config.policy, f"({policy_source}) {e.hint}") from None
    for name, value in options.items():
        if name in hints and not _accepts(hints[name], value):
            raise ConfigError(f"policy_options.{name}", value, f"({source}) policy {config.policy} takes "
                                                               f"{_hint_text(hints[name])} here")
    try:
        make_policy(config.policy, **options)
    except SpecError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError("policy_options", options,
                          f"({source}) not accepted by policy {config.policy}: {e}") from None


def _option_types(cls: type) -> dict[str, object]:
    """A policy's options and their declared types: its constructor's keywords, and the
    fields of its ``config_class`` where it has one ({} where they cannot be read)."""
    import typing

    hints: dict[str, object] = {}
    for source in (getattr(cls, "config_class", None), cls.__init__):
        if source is None:
            continue
        try:
            hints.update(typing.get_type_hints(source))
        except (NameError, TypeError):
            continue
    return {k: v for k, v in hints.items() if k not in ("return", "config")}


def _accepts(hint: object, value: object) -> bool:
    """Whether a YAML ``value`` is of the declared type (numbers: ints for floats too;
    tuples: any list or mapping, which the policy turns into one; others: unchecked)."""
    import types
    import typing

    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return any(_accepts(a, value) for a in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    if hint is tuple or typing.get_origin(hint) is tuple:
        return isinstance(value, (list, tuple, dict))
    return True


def _hint_text(hint: object) -> str:
    """``a whole number``, ``a number or null`` …: a declared type as a config user reads it."""
    import types
    import typing

    words = {bool: "true or false", int: "a whole number", float: "a number", str: "a text",
             type(None): "null"}
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return " or ".join(_hint_text(a) for a in typing.get_args(hint))
    return words.get(hint, "a list")


# What a user command that only reads Slurm needs of the config (`load_config`'s ``only``).
SLURM_ACCESS_KEYS = ("slurm_backend", "slurm_prefix", "slurm_timeout_s", "partitions")


def load_config(config_path: str | None, flags: Mapping[str, object] | None,
                env: Mapping[str, str], only: tuple[str, ...] | None = None) -> DaemonConfig:
    """Read the YAML file (``--config``, else ``$SLURM_EXT_CONFIG``, else none) and resolve.

    ``only``: the keys to read from the file and the environment (the rest keep their
    defaults), so that a command is not failed by a setting it does not use (e.g.
    ``SLURM_EXT_CLUSTER`` set for ``slurm-ext estimate`` and invalid for the daemon)."""
    path = config_path or env.get(ENV_CONFIG)
    file_values = read_yaml(path) if path else {}
    if only is not None:
        file_values = {k: v for k, v in file_values.items() if k in only}
        env = {name: v for name, v in env.items() if name[len(ENV_PREFIX):].lower() in only
               and name.startswith(ENV_PREFIX)}
    return resolve(flags, env, file_values, file_name=str(path) if path else "config file")
