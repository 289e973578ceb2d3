"""The records the store keeps: stored entries, in-flight requests, per-key chains."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tierzero.swap.allocator import round_up
from tierzero.swap.future import Op, SwapFuture
from tierzero.swap.header import HEADER_BYTES

__all__ = ["Entry", "KeyChain", "Request", "byte_view", "max_task_bytes"]

# [Note: short last block] A payload is checksummed in blocks of block_size (one CRC-32
# each, combined into the header's checksum, so the on-disk format depends on the block
# size alone), and moved in one I/O per block, except that a last block of at most
# 1/TAIL_RIDES of a block moves in the same I/O as the block before it: a payload of one
# block and a little more (an 8-bit moment piece: 1 MiB of codes and 16 KiB of scales)
# is one I/O, not two, and the short one does not wait its turn in the drive's queue
# behind whole blocks. CRCs are still taken per block.
TAIL_RIDES = 8


def max_task_bytes(block_size: int) -> int:
    """The largest payload span one I/O moves: a block and the short last one riding
    with it ([Note: short last block]); an I/O thread's bounce buffer holds this many."""
    return round_up(block_size + block_size // TAIL_RIDES)


@dataclass(frozen=True)
class Entry:
    """A committed key: where its region is and what its header says."""

    offset: int  # region start in the data file, ALIGN-aligned
    nbytes: int  # payload bytes
    dtype: torch.dtype
    shape: tuple[int, ...]
    generation: int
    checksum: int | None

    @property
    def region_bytes(self) -> int:
        return region_bytes(self.nbytes)


def region_bytes(nbytes: int) -> int:
    return HEADER_BYTES + round_up(nbytes)


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor sharing its memory (no copy)."""
    flat = tensor.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


@dataclass(eq=False)
class Request:
    """One write or read, from submission to completion.

    Life: waiting on `deps_left` earlier requests of the same key -> runnable ->
    in service (blocks handed to the I/O threads, see [Note: swap I/O order];
    at most `queue_depth` requests in service) -> finished (future set).
    """

    op: Op
    key: str
    future: SwapFuture
    data: torch.Tensor  # 1D uint8 view of the caller's tensor, CPU, contiguous
    view: memoryview  # the same bytes, for os.pwrite / os.preadv
    generation: int  # write: the generation it creates; read: unused (0)
    direct_buffer: bool  # caller's buffer is ALIGN-aligned (O_DIRECT without a bounce)
    block_size: int
    deps_left: int = 0
    dependents: list[Request] = field(default_factory=list)
    entry: Entry | None = None  # write: the entry it commits; read: the entry it reads
    next_block: int = 0  # next block to hand to an I/O thread
    completed: int = 0  # blocks finished (or skipped after an error)
    finishing: bool = False
    crcs: list[int] = field(default_factory=list)  # per-block CRC-32, block order
    error: BaseException | None = None
    started: float = 0.0  # perf_counter when it entered service
    background: bool = False  # a read that yields to every other ([Note: swap I/O order])
    idle: bool = False  # a read of a kept region, served last (SwapStore.read_kept)

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    @property
    def n_blocks(self) -> int:
        """Checksum blocks (one CRC-32 each); at least 1."""
        return max(1, -(-self.nbytes // self.block_size))

    @property
    def n_tasks(self) -> int:
        """I/Os to move the payload: one per block, the short last one riding with the
        block before it ([Note: short last block]); at least 1 so an empty payload still
        gets its header step."""
        n = self.n_blocks
        tail = self.nbytes - (n - 1) * self.block_size
        return n - 1 if n >= 2 and tail <= self.block_size // TAIL_RIDES else n

    def block(self, index: int) -> tuple[int, int]:
        """(payload offset, length) of I/O `index`; length 0 for an empty payload."""
        start = index * self.block_size
        if index < self.n_tasks - 1:
            return start, self.block_size
        return start, max(0, self.nbytes - start)

    def crc_blocks(self, index: int) -> list[tuple[int, int, int]]:
        """(block number, payload offset, length) of each checksum block I/O `index`
        moves."""
        start, length = self.block(index)
        first = start // self.block_size
        return [(first + i, lo, min(self.block_size, start + length - lo))
                for i, lo in enumerate(range(start, start + length, self.block_size))]

    def all_issued(self) -> bool:
        return self.error is not None or self.next_block >= self.n_tasks


@dataclass
class KeyChain:
    """Pending requests of one key, for ordering (see SwapStore's ordering rules)."""

    last_write: Request | None = None
    readers: list[Request] = field(default_factory=list)  # reads since last_write

    def pending(self) -> list[Request]:
        return ([self.last_write] if self.last_write else []) + list(self.readers)
