"""Keys of the prefix-state cache (server/cache/prefix_cache.py): the hash chain over a prompt's
token blocks, scoped to (model, owner, cache_salt). Torch-free: the API process computes a
request's scope with `scope_key` and sends it to the engine process."""

from __future__ import annotations

import hashlib
import sys
from array import array

DIGEST_BYTES = 16


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for part in parts:
        h.update(part)
    return h.digest()


def _token_bytes(tokens: list[int]) -> bytes:
    """Token ids as 4-byte little-endian words: one conversion for a whole prompt."""
    words = array("I", tokens)
    if sys.byteorder != "little":
        words.byteswap()
    return words.tobytes()


def scope_key(model: str, owner: str | None, salt: str | None) -> bytes:
    """The seed of a scope's hash chain: entries of one (model, owner, salt) are never another's."""
    fields = [model, "" if owner is None else owner, "" if salt is None else salt]
    return _digest(b"xlserve-prefix-v1\0", *(f.encode("utf-8") + b"\0" for f in fields))


def block_chain(scope: bytes, tokens: list[int], block_tokens: int) -> list[bytes]:
    """[h_0, h_1, ..., h_K], h_k the chain hash of the first k full blocks (K = len // B)."""
    chain, data, width = [scope], _token_bytes(tokens), 4 * block_tokens
    for start in range(0, 4 * (len(tokens) - block_tokens + 1), width):
        chain.append(_digest(chain[-1], data[start : start + width]))
    return chain


def entry_key(chain: list[bytes], tokens: list[int], n: int, block_tokens: int) -> bytes:
    """The key of the entry for tokens[:n] (chain from `block_chain` over at least n tokens)."""
    k = n // block_tokens
    return _digest(chain[k], _token_bytes(tokens[k * block_tokens : n]), n.to_bytes(8, "little"))
