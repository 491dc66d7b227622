"""Paged-KV page allocator with ref counts and a local prefix cache. No tensors.

Pages hold ``page_size`` tokens. A full page whose content is known gets a
hash (the chained chunk key of its tokens); a new sequence whose prompt starts
with the same pages shares them (ref count + 1) instead of recomputing them.
Freed pages keep their hash until reused (lazy eviction): the free list is
ordered least recently freed first, so allocation takes the coldest page and
a prefix hit can pull a page back out of the free list in O(1).
"""

from __future__ import annotations

from collections import OrderedDict


class BlockManager:
    def __init__(self, num_pages: int, page_size: int) -> None:
        assert num_pages > 0 and page_size > 0
        self.num_pages = num_pages
        self.page_size = page_size
        self.ref = [0] * num_pages
        self.page_hash: list[bytes | None] = [None] * num_pages
        self.cached: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num: int) -> bool:
        return num <= len(self._free)

    def allocate(self, num: int) -> list[int]:
        """Takes ``num`` free pages, coldest first (dropping their cached hashes)."""
        if num > len(self._free):
            raise MemoryError(f"{num} pages asked, {len(self._free)} free")
        out = []
        for _ in range(num):
            page, _ = self._free.popitem(last=False)
            h = self.page_hash[page]
            if h is not None:
                if self.cached.get(h) == page:
                    del self.cached[h]
                self.page_hash[page] = None
            self.ref[page] = 1
            out.append(page)
        return out

    def free(self, pages: list[int]) -> None:
        """Drops one reference to each page; unreferenced pages go to the free list's warm end."""
        for page in reversed(pages):  # NOTE: a sequence's tail pages are evicted before its head
            assert self.ref[page] > 0, page
            self.ref[page] -= 1
            if self.ref[page] == 0:
                self._free[page] = None

    def match_prefix(self, hashes: list[bytes]) -> list[int]:
        """Shares the longest run of cached pages whose hashes lead ``hashes``."""
        out = []
        for h in hashes:
            page = self.cached.get(h)
            if page is None:
                break
            if self.ref[page] == 0:
                del self._free[page]
            self.ref[page] += 1
            out.append(page)
        return out

    def register(self, page: int, h: bytes) -> None:
        """Records that a full page holds the tokens hashed as ``h``."""
        if self.page_hash[page] is None and h not in self.cached:
            self.page_hash[page] = h
            self.cached[h] = page
