"""`Cluster`: the processes of one run, as a process finds them.

>>> from keras_layoutmap.cluster import Cluster
>>> Cluster("10.0.0.1:1234", num_processes=2, process_id=1)
Cluster(coordinator_address='10.0.0.1:1234', num_processes=2, process_id=1)
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where the coordinator is, how many processes, and which one this is.

    Where the source says so, also: this process's rank among the processes
    of its host (`local_rank`, which picks its GPU) and how many share the
    host (`local_size`); every process's own `host:port` (`addresses`, for
    runtimes whose processes each listen: DTensor's clients); and `source`,
    the variables it was read from, for error messages.
    """

    coordinator_address: str
    num_processes: int
    process_id: int
    local_rank: int | None = dataclasses.field(default=None, repr=False)
    local_size: int | None = dataclasses.field(default=None, repr=False)
    addresses: tuple | None = dataclasses.field(
        default=None, repr=False, compare=False)
    source: str = dataclasses.field(default="arguments", repr=False,
                                    compare=False)

    def __post_init__(self):
        if self.num_processes < 1:
            raise ValueError(
                f"num_processes must be at least 1. Received: {self.num_processes}"
            )
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"process_id must be in [0, {self.num_processes}). Received: "
                f"{self.process_id}"
            )
        if self.addresses is not None and len(self.addresses) != self.num_processes:
            raise ValueError(
                f"addresses must name each of the {self.num_processes} "
                f"processes. Received {len(self.addresses)}: {self.addresses}")

    def accelerator_index(self):
        """The one accelerator of its host this process takes (its local
        rank) where several processes share the host, else None: a process
        alone on its host (or whose local rank is unknown) takes them all.

        >>> Cluster("h:1", 8, 5, local_rank=1, local_size=4).accelerator_index()
        1
        >>> Cluster("h:1", 2, 1, local_rank=0, local_size=1).accelerator_index() is None
        True
        """
        if self.local_rank is None or self.local_size == 1:
            return None
        return self.local_rank
