"""The arrays of a pytree built on the host and read on the device.

The batch builder fills a step's inputs (AttentionMetadata, SamplingBatch, StepInputs) with numpy arrays, packs
them, and the jitted step reads the same pytree with jax.Arrays: one class, parameterised by its leaves' type."""

from __future__ import annotations

from typing import TypeVar

import jax
import numpy as np

HostOrDevice = TypeVar("HostOrDevice", bound=np.ndarray | jax.Array)
# What a builder fills a pytree with: numpy arrays, or device arrays it placed already (packing moves the others).
HostLeaf = np.ndarray | jax.Array
