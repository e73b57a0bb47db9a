from .distributed_data_parallel import DistributedDataParallel, DistributedDataParallelConfig  # noqa: F401
from .torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel  # noqa: F401
