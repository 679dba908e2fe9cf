"""An example stream (IterableDataset) split between DataLoader workers, for data that cannot be indexed.

With an IterableDataset every worker gets its own copy of the dataset object and iterates it from
the start, so without a split each sample comes out `num_workers` times. `__iter__` therefore asks
`get_worker_info()` which worker it runs in and keeps only its share:

- at least as many shards (files) as readers: whole shards, `shards[me::readers]`, so each file is
  opened by one worker only;
- fewer shards than readers: every reader walks every shard and keeps every `readers`-th record.

`rank` and `world_size` extend the split across processes (torchrun), so readers =
world_size x num_workers. Each sample comes out exactly once per epoch, in an order that depends
on the number of workers.

    loader = DataLoader(ShardedStream(shards, read_shard), batch_size=64, num_workers=4)

A stream goes through a plain DataLoader, not through TrainLoader: it has no index to sample by,
so the exact mid-epoch resume of train.py does not apply to it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from torch.utils.data import IterableDataset, get_worker_info


class ShardedStream(IterableDataset):
    def __init__(self, shards: Sequence, read: Callable[[object], Iterable], rank: int = 0, world_size: int = 1):
        self.shards, self.read, self.rank, self.world_size = list(shards), read, rank, world_size

    def readers(self) -> tuple[int, int]:
        """(this reader's number, how many readers there are) across ranks and workers."""
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return self.rank * workers + worker, self.world_size * workers

    def __iter__(self) -> Iterator:
        me, readers = self.readers()
        if len(self.shards) >= readers:
            for shard in self.shards[me::readers]:
                yield from self.read(shard)
            return
        position = 0  # over the whole stream, so the split does not depend on how records fall into shards
        for shard in self.shards:
            for record in self.read(shard):
                if position % readers == me:
                    yield record
                position += 1
