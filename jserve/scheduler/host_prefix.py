"""The prefix cache's host tier as the scheduler sees it (``jserve.cache.host_tier``): a
lookup goes on on the host where the device's cached run ends, a claim takes the host pages
into fresh device pages, and an admission sends their copies with its plan. Pure Python."""
from __future__ import annotations

from jserve.cache.allocator import PageAllocator
from jserve.scheduler.request import Request


def host_prefix(alloc: PageAllocator, req: Request, num_device: int) -> list[int]:
    """Host slots of ``req``'s leading pages after the device's ``num_device`` (its page keys
    are made by the device lookup). None under a sliding window (not supported yet: a
    windowed claim takes only live pages) or where the request takes no cached pages."""
    if alloc.host is None or alloc.window is not None or not (
            alloc.prefix_caching and req.cacheable and req.takes_cached):
        return []
    pages = (len(req.all_token_ids) - 1) // alloc.page_size
    return alloc.host.lookup(req.page_keys[num_device:pages])


def claim_host(alloc: PageAllocator, req: Request, num_device: int) -> None:
    """After the device's ``num_device`` cached pages, the host's: as many as the pool holds
    come back by copy into fresh pages (pinned until the plan is built; ``restore`` at
    admission, ``unclaim_host`` if it fails)."""
    slots = host_prefix(alloc, req, num_device)
    req.restore_hint = 0
    slots = slots[:alloc.extendable(req.page_ids)]
    if slots:
        alloc.host.pin(slots)
        fresh = alloc.extend(req.page_ids, len(slots))
        req.page_ids = req.page_ids + fresh
        req.restoring = list(zip(slots, fresh))
        req.num_computed = req.num_cached_tokens = len(req.page_ids) * alloc.page_size


def unclaim_host(alloc: PageAllocator, req: Request) -> None:
    """A failed admission's host pages stay on the host (their fresh pages, never
    registered, go back free with the rest)."""
    req.restore_hint = len(req.restoring)
    if req.restoring:
        alloc.host.unpin([slot for slot, _ in req.restoring])
        req.restoring = []


def restore(alloc: PageAllocator, req: Request) -> int:
    """An admission's host pages: their copies go with this plan (before its step), and their
    fresh pages are registered now, so later admissions share them rather than restore them
    again. Returns the tokens restored."""
    req.num_restored_tokens = 0
    if not req.restoring:
        return 0
    slots, pages = zip(*req.restoring)
    alloc.host.restore(slots, pages)
    first = req.num_registered_pages
    for j in range(first, first + len(pages)):
        alloc.register(req.page_ids[j], req.page_keys[j])
    req.num_registered_pages = first + len(pages)
    req.num_restored_tokens = len(pages) * alloc.page_size
    req.restoring = []
    return req.num_restored_tokens
