"""A deterministic synthetic data stream indexed by training step.

Batch ``step`` depends only on (seed, step, global batch, shapes), never on what ran
before, so a job that stops after step 40 and restarts under another plan reads exactly
the batch an uninterrupted run would have read at step 41. The data position stored in
a checkpoint is therefore just the next step (plus the seed, to detect a mismatch).

Token batches follow a learnable rule (each sequence counts up by a per-sequence stride,
with a little noise) so the loss visibly falls; image batches are Gaussian images with a
class label derived from their mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from estimator.errors import SpecError


@dataclass(frozen=True)
class Batch:
    """One global batch on the host: model inputs and the targets of the loss."""

    inputs: np.ndarray
    targets: np.ndarray


@dataclass(frozen=True)
class TokenStream:
    """Seeded language-model batches: ``inputs`` and next-token ``targets``, int32 [B, S]."""

    seed: int
    global_batch: int
    seq_len: int
    vocab_size: int
    noise_frac: float = 0.05

    def __post_init__(self):
        for name in ("global_batch", "seq_len", "vocab_size"):
            if getattr(self, name) <= 0:
                raise SpecError(name, getattr(self, name), "give a positive integer")

    def batch(self, step: int) -> Batch:
        """The global batch of training step ``step`` (steps count from 1)."""
        if step < 0:
            raise SpecError("step", step, "steps are non-negative")
        rng = np.random.Generator(np.random.PCG64([self.seed, step]))
        b, s, v = self.global_batch, self.seq_len, self.vocab_size
        start = rng.integers(0, v, size=(b, 1))
        stride = rng.integers(1, min(v, 8) + 1, size=(b, 1))
        tokens = (start + stride * np.arange(s + 1)[None, :]) % v
        noise = rng.random((b, s + 1)) < self.noise_frac
        tokens = np.where(noise, rng.integers(0, v, size=(b, s + 1)), tokens)
        tokens = tokens.astype(np.int32)
        return Batch(tokens[:, :-1], tokens[:, 1:])


@dataclass(frozen=True)
class ImageStream:
    """Seeded image-classification batches: float32 [B, H, W, C] and int32 labels [B]."""

    seed: int
    global_batch: int
    image_size: int
    channels: int
    num_classes: int

    def batch(self, step: int) -> Batch:
        """The global batch of training step ``step``."""
        if step < 0:
            raise SpecError("step", step, "steps are non-negative")
        rng = np.random.Generator(np.random.PCG64([self.seed, step]))
        b = self.global_batch
        images = rng.standard_normal((b, self.image_size, self.image_size, self.channels),
                                     dtype=np.float32)
        # A label the model can learn: which bucket the image's mean falls into.
        means = images.mean(axis=(1, 2, 3)) * np.sqrt(images[0].size)
        labels = np.clip(((means + 3.0) / 6.0 * self.num_classes).astype(np.int32),
                         0, self.num_classes - 1)
        return Batch(images, labels)


def stream_for(arch, seed: int, global_batch: int) -> TokenStream | ImageStream:
    """The synthetic stream of a built-in model family (``estimator.jax_models.Arch``)."""
    if arch.family == "wide_resnet":
        return ImageStream(seed, global_batch, arch.image_size, 3, arch.num_classes)
    return TokenStream(seed, global_batch, arch.seq_len, arch.vocab)
