"""`data.batch_transform`: a transform of whole training batches on the device (torchvision.transforms.v2 MixUp or
CutMix, or your own), with randomness that belongs to the batch, not to the process.

Before each batch, python, numpy and torch's CPU generator are seeded from (seed, rank, epoch, batch number) and
put back afterwards: the draws (MixUp's lambda, CutMix's box) are then the same for any loader profile or worker
count, and a resumed run redraws exactly what the stopped one drew. It runs after `data.normalize`, on floats,
and on training batches only. A transform drawing from the CUDA generator is not covered: draw on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import rng

SALT = 0x6D6978  # keeps these draws apart from the data's own per-batch seeding (rng_mode=per_sample)


@dataclass
class SeededBatchTransform:
    transform: object
    seed: int
    rank: int

    def __call__(self, batch, epoch: int, number: int):
        key = np.random.SeedSequence([self.seed, self.rank, epoch, number, SALT]).generate_state(2, np.uint32)
        with rng.kept(cuda=False), torch.no_grad():
            rng.seed_cpu(int(key[0]) << 32 | int(key[1]))
            return self.transform(batch)
