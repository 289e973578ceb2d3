"""DrySwap: a swap store that counts bytes instead of moving them (planning, `tierzero plan`).

Same calls as SwapStore (write, read, delete, keys, stats, close) and the same
per-key rules a caller can observe (a read of an unknown key, or into a buffer
of another size or dtype, raises SwapError), but no file: every request
completes at once and only its payload bytes are counted. Tensors may be on
the meta device, so a plan of a 70B model allocates nothing.
"""

from __future__ import annotations

import threading
from types import TracebackType

import torch

from tierzero.swap.errors import SwapError
from tierzero.swap.future import SwapFuture
from tierzero.swap.kept import KeptRegion
from tierzero.swap.stats import DirectionStats, SwapStats

__all__ = ["DrySwap"]


class DrySwap:
    """Counting stand-in for SwapStore; see the module docstring."""

    path = "<dry run>"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._index: dict[str, tuple[int, torch.dtype]] = {}  # key -> (bytes, dtype)
        self._requests = {"read": 0, "write": 0}
        self._bytes = {"read": 0, "write": 0}
        self._closed = False

    def write(self, key: str, tensor: torch.Tensor) -> SwapFuture:
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            self._check_open(key)
            self._index[key] = (nbytes, tensor.dtype)
            self._requests["write"] += 1
            self._bytes["write"] += nbytes
        return _completed("write", key, tensor)

    def keep(self, key: str) -> KeptRegion:
        raise SwapError("a dry run keeps no regions (it saves no checkpoints)", path=self.path,
                        key=key)

    def read_kept(self, region: KeptRegion, out: torch.Tensor) -> SwapFuture:
        raise SwapError("a dry run keeps no regions (it saves no checkpoints)", path=self.path,
                        key=region.key)

    def release_kept(self, region: KeptRegion) -> None:
        del region  # nothing was kept

    def restore(self, region: KeptRegion) -> None:
        raise SwapError("a dry run keeps no regions (it speculates no step)", path=self.path,
                        key=region.key)

    def reserve_free(self, nbytes: int) -> None:
        del nbytes  # counts bytes only

    def read(self, key: str, out: torch.Tensor | None = None, *,
             background: bool = False) -> SwapFuture:
        del background  # nothing is queued here
        with self._lock:
            self._check_open(key)
            entry = self._index.get(key)
            if entry is None:
                raise SwapError("unknown key: nothing is stored under it", path=self.path,
                                key=key)
            if out is None:
                raise SwapError("a dry run reads only into a given buffer (out=)",
                                path=self.path, key=key)
            nbytes = out.numel() * out.element_size()
            if (nbytes, out.dtype) != entry:
                raise SwapError(f"stored {entry[1]} of {entry[0]} bytes, the read buffer is "
                                f"{out.dtype} of {nbytes} bytes", path=self.path, key=key)
            self._requests["read"] += 1
            self._bytes["read"] += nbytes
        return _completed("read", key, out)

    def delete(self, key: str) -> None:
        with self._lock:
            self._check_open(key)
            if self._index.pop(key, None) is None:
                raise SwapError("unknown key: cannot delete, nothing is stored under it",
                                path=self.path, key=key)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._index)

    def stats(self) -> SwapStats:
        """Bytes and requests per direction; busy time is 0 (nothing ran)."""
        with self._lock:
            used = sum(n for n, _ in self._index.values())
            return SwapStats(
                write=DirectionStats(self._requests["write"], 0, self._bytes["write"], 0.0, 0),
                read=DirectionStats(self._requests["read"], 0, self._bytes["read"], 0.0, 0),
                file_bytes=used, used_bytes=used, keys=len(self._index), direct=False)

    def close(self) -> None:
        self._closed = True

    def _check_open(self, key: str) -> None:
        if self._closed:
            raise SwapError("swap store is closed", path=self.path, key=key)

    def __enter__(self) -> DrySwap:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _completed(op: str, key: str, tensor: torch.Tensor) -> SwapFuture:
    fut = SwapFuture("read" if op == "read" else "write", key, tensor)
    fut.set_result(tensor)
    return fut
