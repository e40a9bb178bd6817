"""How the KV cache's room splits between the KV pool's pages and, for a model whose
sliding-window layers keep only their window (:mod:`engine.kvcache.ring`), the ring pool
of those layers: :func:`ring_pool_cap` chooses the ring pool's size, :func:`kv_pages` the
pages beside it. Torch-free.

The ring pool never runs short before the KV pool where it holds its bound, the rings of
every running request and the prefix cache's checkpoints (``full_cap``). On a desktop
card that bound can take most of the room (Gemma 3 4B at the defaults: 64 requests x 65
pages of 29 layers) and cut the context of every request to a fraction of the model's,
though one user rarely runs many long requests at once. So the plan keeps the bound only
where the room holds it beside the whole wanted context; else it gives the KV pool the
wanted context first and the ring pool what is left, at least the rings of
``RING_FLOOR_REQUESTS`` requests (the parallel sequences llama.cpp's server plans for by
default). Requests whose rings do not fit then wait or are preempted for ring pages, as
for KV pages (:mod:`engine.scheduler.ring_growth`); a short request's ring holds only its
own pages, so many short requests still run together.
"""

from __future__ import annotations

# Requests at their whole window the ring pool holds at least when it is sized below its
# bound (the parallel sequences llama.cpp's server plans for by default).
RING_FLOOR_REQUESTS = 4


def kv_pages(room: int, page_bytes: int, ring_page: int = 0, ring_cap: int = 0) -> int:
    """The most KV pool pages ``P`` whose cost fits ``room`` bytes, the inverse of ``P x
    page_bytes + min(ring_cap, P) x ring_page`` (pages of the global layers, and a
    sliding-window ring pool of ``min(ring_cap, P)`` pages: :mod:`engine.kvcache.ring`);
    0 when nothing fits or a page costs nothing."""
    if room <= 0 or page_bytes <= 0:
        return 0
    both = page_bytes + ring_page
    if room < ring_cap * both:
        return room // both
    return ring_cap + (room - ring_cap * both) // page_bytes


def ring_pool_cap(room: int, page_bytes: int, ring_page: int, full_cap: int, floor_cap: int,
                  wanted_pages: int) -> int:
    """The ring pool's pages (its null page apart) the plan allows, given ``room`` bytes
    for the KV pool of ``page_bytes`` pages and the ring pool of ``ring_page`` pages:
    ``full_cap`` (the rings' bound and the checkpoints) where the room holds it beside
    ``wanted_pages`` KV pool pages (the wanted context), else the ring pages the room
    leaves beside those pages, at least ``floor_cap`` (the rings of
    :data:`RING_FLOOR_REQUESTS` requests) and at most ``full_cap``. 0 without a ring
    (``ring_page`` 0)."""
    if ring_page <= 0:
        return 0
    if wanted_pages * page_bytes + min(wanted_pages, full_cap) * ring_page <= room:
        return full_cap
    spare = max(room - wanted_pages * page_bytes, 0) // ring_page
    return max(min(floor_cap, full_cap), min(full_cap, spare))


def ring_line(rings: int, ring_page_text: str, *, cap: int, kv_pages: int, full_cap: int, ring_pages: int,
              checkpoint_pages: int, requests: int, checkpoints: int, decode_pages: int,
              floor_requests: int) -> str:
    """The ledger's words on a ring pool of ``rings`` pages (of ``ring_page_text`` each),
    at most ``cap`` (:func:`ring_pool_cap`'s) and the KV pool's ``kv_pages``: what bounds
    it (the KV pool's pages; the room left beside the wanted context; or its bound
    ``full_cap``, ``ring_pages`` for the rings of ``requests`` running requests and
    ``checkpoint_pages`` for ``checkpoints`` prefix-cache checkpoints), and about how
    many requests hold a whole window (``decode_pages`` each) at once."""
    made_of = (f"the rings of {requests} requests ({ring_pages} pages) and {checkpoints} prefix-cache checkpoints "
               f"({checkpoint_pages} pages)")
    if rings < cap:
        bound = f"as many as the KV pool's {kv_pages} pages, fewer than the {full_cap} of {made_of}"
    elif cap < full_cap:
        whole = min(max(rings // max(decode_pages, 1), 1), requests)
        bound = (f"fewer than the {full_cap} of {made_of}, so that the KV pool holds the context first; about "
                 f"{whole} requests at their whole window at once (never fewer than {floor_requests}); a request "
                 f"whose ring does not fit waits for ring pages")
    else:
        bound = made_of
    return (f"exact, {rings} pages of {ring_page_text}: {bound}. A request's ring holds its window ({decode_pages} "
            f"pages) between steps and a prefill chunk's pages more in its step; and the null page")
