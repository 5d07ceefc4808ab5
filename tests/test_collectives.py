"""The runner's data-parallel collectives are exact: in float64, batch norm over replicas
gives the whole batch's gradient.

Float32 cannot show it on a Wide-ResNet: max-pooling and ReLU turn roundings into
gradient jumps of a few per cent (``benchmarks/wrn_gradient_rounding.py``). In float64 a
wrong backward of the statistics' mean (identity or a sum instead of a mean over the
replicas) moves the gradient by far more than rounding.
"""

import pytest

from conftest import in_jax_child


def _split_against_whole(dp: int) -> dict:
    """Relative difference between the whole batch's gradient and the mean of ``dp``
    replicas' gradients (each of its own mean loss, batch-norm statistics over all
    replicas with ``StageCollectives``), for a conv → batch norm → ReLU → head network."""
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np

    from estimator import jax_models as jm
    from job_scripts.collectives import StageCollectives

    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 6, 6, 3))
    labels = rng.integers(0, 5, 16)
    params = {"conv": rng.standard_normal((3, 3, 3, 8)) * 0.3, "g": 1 + 0.1 * rng.standard_normal(8),
              "b": 0.1 * rng.standard_normal(8), "w": rng.standard_normal((8, 5)) * 0.3}

    def loss(p, x, y, tp):
        h = jm._conv(x, p["conv"])
        h, _, _ = jm._batch_norm(h, p["g"], p["b"], jnp.zeros(8), jnp.ones(8), tp)
        logits = jax.nn.relu(h).mean(axis=(1, 2)) @ p["w"]
        return jm.loss_fn(logits, y, tp)

    whole = jax.grad(loss)(params, x, labels, jm.GLOBAL_TP)
    tp = StageCollectives((), ("dp",), dp)
    each = jax.vmap(jax.grad(lambda p, x, y: loss(p, x, y, tp)), (None, 0, 0), axis_name="dp")(
        params, x.reshape(dp, -1, *x.shape[1:]), labels.reshape(dp, -1))
    split = jax.tree.map(lambda g: g.mean(axis=0), each)
    return {k: float(np.linalg.norm(split[k] - whole[k]) / np.linalg.norm(whole[k])) for k in whole}


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_batch_norm_over_replicas_gives_the_whole_batch_gradient(dp):
    differences = in_jax_child(1, _split_against_whole, dp)
    assert set(differences) == {"conv", "g", "b", "w"}
    assert max(differences.values()) < 1e-10, differences
