"""Sia's throughput model of one job: Pollux's compute/communication model per GPU type,
bootstrapped from a minimal-configuration profile and refitted from observed runs.

Sia (SOSP'23) keeps, per job and GPU type, the Pollux performance model
(``sia-simulator/goodput.py``: ``PerfParams``, ``fit_perf_params``) of one iteration::

    compute(R)    = alpha_c + beta_c · b(R)            b(R): local batch of R replicas
    network(R, k) = 0                                   R = 1
                  = alpha_r + beta_r · max(R − 2, 0)    R > 1 on one node
                  = alpha_n + beta_n · max(R − 2, 0)    R > 1 over k > 1 nodes
    T(R, k)       = (compute^gamma + network^gamma)^(1/gamma),  gamma ∈ [1, 10]

fitted to the observed step times by least squares on log times, with Sia's priors:
parameters no observation can inform are pinned at their lower bound (no multi-node run:
``alpha_n, beta_n``; no single-node multi-replica run: ``alpha_r, beta_r``; no run on more
than two replicas: both ``beta``), a small pull of ``gamma`` towards 1 and of the
retrogression terms towards 0, and, without a multi-node run, inter-node communication at
least 1.1 × the intra-node one.

In this repository the global batch is fixed, so a job's R replicas each take B / R of
it and goodput equals throughput (no batch-size adaptation). A *replica* is the job's
smallest runnable GPU count on the type (its "scale unit", as Sia's pipeline-parallel
jobs have one); times are fitted in units of the job's global batch, so ``beta_c`` is the
compute time of the whole batch on one replica.

Where it differs from Sia's code, because of the setting:

* Sia profiles one GPU at several batch sizes, which pins ``alpha_c``; with only one
  local batch seen its code fixes ``alpha_c`` at half the compute time, an *optimistic*
  prior when the batch grows with the replicas. With a fixed global batch the local batch
  shrinks instead and the same rule would be pessimistic, so the optimistic prior here is
  ``alpha_c`` at its lower bound (compute proportional to the local batch) until two
  replica counts have been seen.
* Only step times are observed (the estimator and the runner report no compute/sync
  split), so the fit has Sia's step-time term and no separate compute-time term.
* The bootstrap profile of a type is the snapshot's estimate of the job's smallest
  runnable Cell there (measured with ``--oracle``); an observation of the same layout
  replaces it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize

LOWER = 1e-8  # Sia's lower bound on every time parameter
GAMMA_MAX = 10.0
INTER_OVER_INTRA = 1.1  # Sia's prior without a multi-node observation


@dataclass(frozen=True)
class PerfParams:
    """Sia's per-type model, times in seconds for the job's whole global batch.

    Attributes:
        alpha_c_s, beta_c_s: compute time = alpha_c_s + beta_c_s / replicas.
        alpha_r_s, beta_r_s: intra-node sync = alpha_r_s + beta_r_s · max(replicas − 2, 0).
        alpha_n_s, beta_n_s: inter-node sync, the same form.
        gamma: overlap of compute and sync (1: none, 10: nearly full).
    """

    alpha_c_s: float
    beta_c_s: float
    alpha_r_s: float
    beta_r_s: float
    alpha_n_s: float
    beta_n_s: float
    gamma: float

    def iteration_time_s(self, replicas: float, num_nodes: int) -> float:
        """Seconds per iteration on ``replicas`` replicas spread over ``num_nodes`` nodes."""
        return _time(self.as_tuple(), replicas, num_nodes)

    def as_tuple(self) -> tuple[float, ...]:
        return (self.alpha_c_s, self.beta_c_s, self.alpha_r_s, self.beta_r_s,
                self.alpha_n_s, self.beta_n_s, self.gamma)


@dataclass(frozen=True)
class Point:
    """One step time: ``replicas`` replicas on ``num_nodes`` nodes took ``iteration_time_s``."""

    replicas: float
    num_nodes: int
    iteration_time_s: float


def _time(params, replicas: float, num_nodes: float) -> float:
    """One iteration's time under ``params`` (plain floats: the fit calls this thousands of times)."""
    a_c, b_c, a_r, b_r, a_n, b_n, gamma = params
    compute = a_c + b_c / replicas
    if replicas <= 1.0 + 1e-9:
        network = LOWER
    elif num_nodes > 1:
        network = a_n + b_n * max(replicas - 2.0, 0.0)
    else:
        network = a_r + b_r * max(replicas - 2.0, 0.0)
    if gamma == 1.0:
        return compute + network
    return (compute ** gamma + network ** gamma) ** (1.0 / gamma)


def fit_perf_params(points: tuple[Point, ...]) -> PerfParams:
    """Sia's fit of the model to ``points`` (see the module docstring for the priors).

    Deterministic: the same points give the same parameters.
    """
    if not points:
        raise ValueError("fit_perf_params needs at least one point")
    replicas = np.asarray([p.replicas for p in points], float)
    nodes = np.asarray([p.num_nodes for p in points], float)
    # Time in units of the slowest point, so the optimizer's scales do not depend on the model.
    scale_s = max(p.iteration_time_s for p in points)
    times = np.asarray([p.iteration_time_s for p in points], float) / scale_s
    multi = replicas > 1.0 + 1e-9
    init = [0.1, 1.0, 0.1, 0.01, 0.1, 0.01, 1.0 + 1e-3]
    free = [True] * 7
    if len(np.unique(np.round(replicas, 9))) == 1:
        free[0] = False  # one local batch seen: compute ∝ local batch (see the docstring)
    if not np.any(multi & (nodes > 1)):
        free[4] = free[5] = False
    if not np.any(multi & (nodes == 1)):
        free[2] = free[3] = False
    if not np.any(replicas > 2.0 + 1e-9):
        free[3] = free[5] = False
    fixed = np.asarray([LOWER] * 6 + [1.0])

    slots = [k for k in range(7) if free[k]]

    def full(x) -> list[float]:
        out = list(fixed)
        for k, v in zip(slots, x):
            out[k] = float(v)
        return out

    data = [(p.replicas, p.num_nodes, math.log(p.iteration_time_s / scale_s)) for p in points]

    def objective(x) -> float:
        p = full(x)
        err = math.sqrt(sum((math.log(_time(p, r, k)) - log_t) ** 2 for r, k, log_t in data) / len(data))
        reg_gamma = 1e-3 * (p[6] - 1.0) ** 2
        reg_retro = 1e-2 * ((p[5] / p[4]) ** 2 + (p[3] / p[2]) ** 2)
        return err + reg_gamma + reg_retro

    x0 = np.asarray([v for v, f in zip(init, free) if f])
    if not free[0] and not any(free[2:6]):
        # Compute only, proportional to the local batch: the fit is the single time itself.
        params = fixed.copy()
        params[1] = float(np.exp(np.mean(np.log(times * replicas))))
    else:
        bounds = [(LOWER, None) if k < 6 else (1.0, GAMMA_MAX) for k in range(7) if free[k]]
        result = minimize(objective, x0, method="L-BFGS-B", bounds=bounds, tol=1e-5)  # Sia's tol
        params = np.asarray(full(result.x))
    if not np.any(multi & (nodes > 1)):
        params[4] = max(params[4], params[2] * INTER_OVER_INTRA)
        params[5] = max(params[5], params[3] * INTER_OVER_INTRA)
    params[:6] *= scale_s
    return PerfParams(*(float(v) for v in params))
