"""Seeded, version-stable randomness: our own counter-based hash, not a library RNG stream.

Every random choice streamforge makes is a pure function of integers: a key derived from
(seed, stream, pass, global worker, window) and a counter. We hash with splitmix64 and sort
by the hashes to permute, so the order never changes with a numpy or torch upgrade.
"""

from __future__ import annotations

import hashlib

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def derive_key(*parts: object) -> int:
    """A 64-bit key from any mix of ints and strings (stable across processes and versions)."""
    text = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def splitmix64(counters: np.ndarray, key: int) -> np.ndarray:
    """splitmix64 of ``key + counter * golden`` for each counter (uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        z = np.uint64(key) + (counters.astype(np.uint64) + np.uint64(1)) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def splitmix64_keys(counters: np.ndarray, keys) -> np.ndarray:
    """``splitmix64`` with a key per counter (``keys``: uint64, one per counter or one for
    all): the hashes of several permutations' counters at once."""
    with np.errstate(over="ignore"):  # as splitmix64 computes it, in place
        z = counters.astype(np.uint64)
        z += np.uint64(1)
        z *= _GOLDEN
        z += keys
        shifted = z >> np.uint64(30)
        z ^= shifted
        z *= _M1
        np.right_shift(z, np.uint64(27), out=shifted)
        z ^= shifted
        z *= _M2
        np.right_shift(z, np.uint64(31), out=shifted)
        z ^= shifted
        return z


def permutation(n: int, key: int) -> np.ndarray:
    """A uniformly random permutation of ``range(n)`` determined by ``key``."""
    return np.argsort(splitmix64(np.arange(n, dtype=np.uint64), key), kind="stable")
