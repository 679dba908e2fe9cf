"""What the loader benchmarks share. Run them from the project root: `python -m benchmarks.pN_...`."""

import time


def samples_per_s(loader, epochs: int) -> float:
    """Samples/s over `epochs` timed epochs, after one warm-up epoch (workers start, files enter the page cache)."""
    for _ in loader:
        pass
    samples, began = 0, time.perf_counter()
    for _ in range(epochs):
        for x, _y in loader:
            samples += len(x)
    return samples / (time.perf_counter() - began)
