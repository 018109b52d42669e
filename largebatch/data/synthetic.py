"""Synthetic images for benchmarks: random uint8 pixels and labels fixed by the seed.

1. Labels: ``synthetic_size`` draws in ``[0, num_classes)`` from a generator seeded by
   ``seed`` (the test split uses ``seed + 1``).
2. Pixels: a pool of at most ``POOL_BYTES`` of random 3 x S x S images from the same
   generator; image ``i`` is pool entry ``i % pool``. A benchmark at 224 px therefore
   does not hold gigabytes, and every image is still fixed by (seed, index).
3. The pool is served by ``MemorySource``, so training batches go through the same
   batched crop + flip as the in-memory real data.
"""
from __future__ import annotations

import torch

from largebatch.data.memory import MemorySource

POOL_BYTES = 64 * 2**20


class SyntheticSource(MemorySource):
    def __init__(self, size: int, num_classes: int, image_size: int, *, seed: int, augment: bool, padding: int) -> None:
        gen = torch.Generator().manual_seed(int(seed))
        labels = torch.randint(0, num_classes, (size,), generator=gen, dtype=torch.int64)  # step 1
        per_image = 3 * image_size * image_size
        pool = max(1, min(size, POOL_BYTES // per_image))
        images = torch.randint(0, 256, (pool, 3, image_size, image_size), generator=gen, dtype=torch.uint8)  # step 2
        super().__init__(images, labels, seed=seed, augment=augment, padding=padding)
        self.pool = pool
        self.size = size

    def __len__(self) -> int:
        return self.size

    def _storage(self, index: torch.Tensor) -> torch.Tensor:
        # Step 2: pixels from the pool entry; augmentation stays keyed by the image index.
        return index % self.pool
