from .distributed_data_parallel import DistributedDataParallel, DistributedDataParallelConfig  # noqa: F401
