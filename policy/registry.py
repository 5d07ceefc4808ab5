"""Policy names → implementing classes, resolved lazily.

Each entry is a ``"module:Class"`` string so that importing the registry imports no
policy (and a policy under construction breaks only its own name). A policy class is
constructed with keyword configuration only and must satisfy ``policy.interface.Policy``.
"""

from __future__ import annotations

import importlib
import importlib.util

from estimator.errors import SpecError
from policy.interface import Policy

POLICIES: dict[str, str] = {
    "fcfs": "policy.fcfs:FcfsPolicy",
    "crius": "policy.crius:CriusPolicy",
    "crius-ddl": "policy.crius:CriusDdlPolicy",
    "gavel": "policy.gavel:GavelPolicy",
    "gavel-greedy": "policy.gavel_greedy:GavelGreedyPolicy",
    "elasticflow": "policy.elasticflow:ElasticFlowPolicy",
    "elasticflow-blocking": "policy.elasticflow:ElasticFlowBlockingPolicy",
    "sia": "policy.sia:SiaPolicy",
    "cells-ilp": "policy.cells_ilp:CellsIlpPolicy",
    "cells-ilp-no-restart": "policy.cells_ilp:CellsIlpNoRestartPenalty",
    "cells-ilp-no-type-change": "policy.cells_ilp:CellsIlpNoTypeChange",
    "cells-ilp-no-count-change": "policy.cells_ilp:CellsIlpNoCountChange",
}


def policy_names() -> tuple[str, ...]:
    """Every registered name, in registration order."""
    return tuple(POLICIES)


def available_policy_names() -> tuple[str, ...]:
    """The registered names whose module imports and defines the class."""
    out = []
    for name in POLICIES:
        try:
            policy_class(name)
        except (SpecError, ImportError):
            continue
        out.append(name)
    return tuple(out)


def policy_class(name: str) -> type:
    """The class registered under ``name``.

    Raises:
        SpecError: the name is unknown (the hint lists the valid ones), or its module is
            not importable yet.
    """
    key = name.strip().lower()
    if key not in POLICIES:
        raise SpecError("policy", name, f"unknown policy; known: {', '.join(POLICIES)}")
    module_name, _, class_name = POLICIES[key].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        raise SpecError("policy", name, f"module {module_name} is not available; "
                        f"available: {', '.join(_importable())}") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise SpecError("policy", name, f"{module_name} defines no {class_name}")
    return cls


def make_policy(name: str, **config) -> Policy:
    """A new policy object for ``name``, configured with ``config``."""
    return policy_class(name)(**config)


def _importable() -> list[str]:
    return [n for n, target in POLICIES.items()
            if importlib.util.find_spec(target.partition(":")[0]) is not None]
