"""Which instance of a role the proxy sends a request to: the least loaded, unless one
recently took the same prefix.

A prefix is a chain of block keys (``prefix_keys``): each key covers one block of the
request and every block before it, so two requests share their first ``n`` keys exactly
when they share their first ``n`` blocks. The pool remembers, for the most recent
``capacity`` keys, the instance it last sent a request holding that key to. That instance
probably still has those blocks in its prefix cache, so a request whose leading keys it
remembers goes there (it computes, or installs, only what follows) unless that
instance has more than ``max_imbalance`` requests in flight beyond the least loaded.
Instances forget blocks without telling the proxy, so this is a guess that is cheap
when wrong: the request is served as if it had no prefix in common with anything.

* **Decode instances**: the keys come from the ticket's prompt token ids, one per block
  of the instances' block size; a decode instance that holds a prefix shares those blocks
  instead of installing the pulled copies (``KVCacheManager.swap_in``).
* **Prefill instances**: the proxy has no token ids before the prefill, so the keys come
  from the request's prompt as sent (its text, or its chat messages), one per
  ``TEXT_BLOCK`` characters; requests with a common system prompt share their first keys.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Collection, Sequence

import numpy as np

AFFINITY_CAPACITY = 1 << 16   # keys remembered per pool (oldest forgotten first)
MAX_IMBALANCE = 8             # requests in flight a remembered instance may be ahead by
TEXT_BLOCK = 64               # characters per key of a prompt's text


def prefix_keys(pieces: str | Sequence[int], block: int, salt: str = "") -> list[bytes]:
    """One key per full ``block`` of ``pieces`` (a text's characters or token ids), each
    covering every piece up to its block's end; ``salt`` (the model or adapter asked for)
    starts the chain, so requests for different models never share a key."""
    if block < 1:
        raise ValueError(f"block={block} must be positive")
    if isinstance(pieces, str):
        data, width = pieces.encode("utf-32-le", "surrogatepass"), 4
    else:
        try:
            data, width = np.asarray(pieces, dtype="<i8").tobytes(), 8
        except (OverflowError, TypeError, ValueError):
            return []  # not token ids: no affinity (the instance answers the request's error)
    keys, parent = [], hashlib.blake2b(salt.encode(), digest_size=16).digest()
    for start in range(0, len(pieces) - block + 1, block):
        parent = hashlib.blake2b(parent + data[width * start:width * (start + block)],
                                 digest_size=16).digest()
        keys.append(parent)
    return keys


def prompt_keys(body: dict) -> list[bytes]:
    """Keys of an OpenAI request's prompt as sent: ``prompt`` (text or token ids) for
    completions, ``messages`` for chat."""
    salt = str(body.get("model", ""))
    if "messages" in body:
        try:
            text = json.dumps(body["messages"], sort_keys=True, ensure_ascii=False)
        except (TypeError, ValueError):
            return []
        return prefix_keys(text, TEXT_BLOCK, salt)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prefix_keys(prompt, TEXT_BLOCK, salt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prefix_keys(prompt, 16, salt)
    return []  # a batch of prompts, or nothing usable: no affinity


class InstancePool:
    """Instances of one role with their requests in flight and the prefixes last sent to
    each (see the module docstring for the rule)."""

    def __init__(self, urls: list[str], *, max_imbalance: int = MAX_IMBALANCE,
                 capacity: int = AFFINITY_CAPACITY) -> None:
        if not urls:
            raise ValueError("the proxy needs at least one instance of each role")
        if max_imbalance < 0:
            raise ValueError(f"max_imbalance={max_imbalance} must be >= 0")
        self.in_flight = {url.rstrip("/"): 0 for url in urls}
        self.max_imbalance = max_imbalance
        self.capacity = capacity
        self._owner: OrderedDict[bytes, str] = OrderedDict()  # key -> instance last sent it
        self.num_affinity_routed = 0  # requests sent to a remembered instance over the least loaded

    def pick(self, keys: Sequence[bytes] = (), avoid: Collection[str] = ()) -> str:
        """The instance for a request with prefix ``keys``; remembers them for it.
        Instances in ``avoid`` (that just refused the request) are taken only when every
        instance is in it."""
        candidates = [u for u in self.in_flight if u not in avoid] or list(self.in_flight)
        url = min(candidates, key=self.in_flight.get)
        if keys and len(candidates) > 1:
            owner, _ = self.remembered(keys)
            if (owner in candidates and owner != url
                    and self.in_flight[owner] - self.in_flight[url] <= self.max_imbalance):
                url = owner
                self.num_affinity_routed += 1
        self.remember(keys, url)
        return url

    def remembered(self, keys: Sequence[bytes]) -> tuple[str | None, int]:
        """(the instance the leading ``keys`` were last sent to, how many of them), or
        (None, 0); the run ends at the first key forgotten or sent elsewhere."""
        owner, count = None, 0
        for key in keys:
            last = self._owner.get(key)
            if last is None or (owner is not None and last != owner):
                break
            owner, count = last, count + 1
        return owner, count

    def remember(self, keys: Sequence[bytes], url: str) -> None:
        for key in keys:
            self._owner[key] = url
            self._owner.move_to_end(key)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
