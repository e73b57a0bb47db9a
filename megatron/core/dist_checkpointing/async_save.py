"""Write a sharded checkpoint in the background while training goes on.

:class:`AsyncSave` copies the chunks this rank saves into private CPU tensors (so the training
step may change the parameters at once) and runs :func:`serialization.save` in a thread. The
thread's collectives run on the process group given, which must be used by nothing else
meanwhile (a dedicated gloo group): the training thread keeps using the others.

The caller decides when the save is over: :meth:`done` is local; every rank must call
:meth:`wait` before the checkpoint is marked complete (metadata.json, tracker).
"""

from __future__ import annotations

import threading
from typing import Dict, Optional

from .mapping import Chunk, ShardedTensor
from .serialization import save


def stage(sharded_state_dict: Dict[str, ShardedTensor]) -> Dict[str, ShardedTensor]:
    """Private CPU copies of the chunks this rank writes (replicas are left out)."""
    staged = {}
    for key, entry in sharded_state_dict.items():
        if entry.replica:
            continue
        # Each chunk becomes its own compact tensor, so the copy holds only what is written.
        for chunk in entry.chunks:
            data = entry.view(chunk).detach().to("cpu", copy=True).contiguous()
            zeros = (0,) * len(chunk.shape)
            part = ShardedTensor(
                key, data, entry.global_shape, (Chunk(chunk.global_offset, zeros, chunk.shape),)
            )
            if key in staged:
                prev = staged[key]
                staged[key] = _merge(prev, part)
            else:
                staged[key] = part
    return staged


class _MultiChunk(ShardedTensor):
    """A staged entry whose chunks live in separate tensors."""

    def __init__(self, key, global_shape, parts):
        self.parts = parts  # {global offset: tensor}
        first = next(iter(parts.values()))
        super().__init__(
            key,
            first,
            global_shape,
            tuple(Chunk(off, (0,) * len(t.shape), tuple(t.shape)) for off, t in parts.items()),
        )

    def view(self, chunk: Chunk):
        return self.parts[chunk.global_offset]


def _merge(prev: ShardedTensor, part: ShardedTensor) -> ShardedTensor:
    parts = (
        dict(prev.parts)
        if isinstance(prev, _MultiChunk)
        else {prev.chunks[0].global_offset: prev.data}
    )
    parts[part.chunks[0].global_offset] = part.data
    return _MultiChunk(prev.key, prev.global_shape, parts)


class AsyncSave:
    """One checkpoint being written by a background thread."""

    def __init__(
        self, sharded_state_dict: Dict[str, ShardedTensor], directory: str, process_group=None
    ):
        self.directory = directory
        self.error: Optional[BaseException] = None
        self._staged = stage(sharded_state_dict)
        self._thread = threading.Thread(
            target=self._run, args=(process_group,), name="async-checkpoint-save", daemon=True
        )
        self._thread.start()

    def _run(self, process_group) -> None:
        try:
            save(self._staged, self.directory, process_group=process_group)
        except BaseException as exc:  # re-raised in the training thread by wait()
            self.error = exc
        finally:
            self._staged = None

    def done(self) -> bool:
        """True once this rank's part is written (or failed)."""
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Block until this rank's part is written; re-raise a failure of the writer thread."""
        self._thread.join()
        if self.error is not None:
            raise self.error
