"""swap: the NVMe tier. Swap files, aligned asynchronous reads and writes.

Knows files, offsets, bytes and futures; nothing of tensors' meaning.
"""

__all__: list[str] = []
