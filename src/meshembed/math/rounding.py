"""Low-precision storage: float32 <-> bfloat16 / float16 bit patterns, rounded to nearest even
or stochastically with a counter-based generator, written once over an Array-API namespace.

Everything here is integer array arithmetic on ``int32`` arrays (``xp.int32``): no float16 or
bfloat16 dtype is needed (NumPy and the Array API standard have no bfloat16; the standard has
no float16), no 64-bit integer (JAX without x64 has none), no unsigned 32-bit arithmetic (torch
supports little of it), and every intermediate value fits a signed int32. A float32 enters as
its bit pattern (``Backend.bitcast(x, "int32")``) and a 16-bit value is kept as its pattern in
an ``int16`` array, so every library holds and computes the same bits. docs/low_precision.md
specifies each function bit by bit; the tests check them against a plain NumPy reference.

* :func:`philox4x32` — Random123's Philox-4x32-10 (Salmon et al., SC'11), each 32-bit word held
  as two 16-bit limbs; :func:`random_words` keys it by (seed, table, array) and counts by
  (column group, row id, step), so a value's random bits do not depend on thread, shard count,
  batch order or backend.
* :func:`round_bits` — float32 bits -> 16-bit patterns, to nearest even or stochastically (add
  a uniform random integer below the dropped bits, then truncate).
* :func:`widen_bits` — 16-bit patterns -> float32 bits (exact).
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = [
    "LOW_PRECISION", "PHILOX_ROUNDS", "ROUNDINGS", "STORAGE_DTYPES", "counters", "interleave", "philox4x32",
    "narrow", "philox_words", "random_words", "round_bits", "stream_of", "widen", "widen_bits", "words_for",
]

#: Storage dtypes of a table or slot: float32 (stored as is) and the two 16-bit formats.
STORAGE_DTYPES = ("float32", "bfloat16", "float16")
LOW_PRECISION = ("bfloat16", "float16")
ROUNDINGS = ("stochastic", "nearest")

PHILOX_ROUNDS = 10
PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # the round multipliers
PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # the key's Weyl increments
_MASK16 = 0xFFFF
_INT32_MIN = -(2**31)

Array = Any
Word = tuple  # (lo, hi): a uint32 as two int32 arrays (or Python ints) in [0, 2**16)


# -- Philox-4x32 over 16-bit limbs --------------------------------------------------------------
def _split(value: int) -> Word:
    value &= 0xFFFFFFFF
    return (value & _MASK16, value >> 16)


def _xor(a: Word, b: Word) -> Word:
    return (a[0] ^ b[0], a[1] ^ b[1])


def _mulhilo(xp: Any, m: int, c: Word) -> tuple[Word, Word]:
    """``(hi, lo)`` words of the 64-bit product ``m * c`` (``m`` a 32-bit constant): ``c`` cut
    into bytes and ``m`` into 16-bit halves, so each partial product is below 2**24; the
    partial products are summed into four 16-bit columns (each sum below 2**26), then the
    carries are propagated."""
    m0, m1 = m & _MASK16, m >> 16
    c0, c1 = c
    a0, a1 = xp.bitwise_and(c0, 0xFF), xp.bitwise_right_shift(c0, 8)
    a2, a3 = xp.bitwise_and(c1, 0xFF), xp.bitwise_right_shift(c1, 8)

    def odd(t: Array) -> tuple[Array, Array]:  # t * 2**8: (part in this column, part in the next)
        return xp.bitwise_and(t, 0xFF) * 256, xp.bitwise_right_shift(t, 8)

    l00, h00 = odd(m0 * a1)
    l01, h01 = odd(m0 * a3)
    l10, h10 = odd(m1 * a1)
    l11, h11 = odd(m1 * a3)
    s0 = m0 * a0 + l00
    s1 = h00 + m0 * a2 + l01 + m1 * a0 + l10
    s2 = h01 + h10 + m1 * a2 + l11
    s3 = h11
    s1 = s1 + xp.bitwise_right_shift(s0, 16)
    s2 = s2 + xp.bitwise_right_shift(s1, 16)
    s3 = s3 + xp.bitwise_right_shift(s2, 16)
    lo = (xp.bitwise_and(s0, _MASK16), xp.bitwise_and(s1, _MASK16))
    hi = (xp.bitwise_and(s2, _MASK16), xp.bitwise_and(s3, _MASK16))
    return hi, lo


def philox4x32(xp: Any, counter: Sequence[Word], key: tuple[int, int], rounds: int = PHILOX_ROUNDS) -> list[Word]:
    """Philox-4x32-``rounds`` of Random123: four 32-bit counter words (each ``(lo, hi)``, int32
    arrays of 16-bit limbs that broadcast together, or Python ints) under a 64-bit key
    ``(k0, k1)`` (Python ints, the same for every element) -> four random words, as limbs.

    One round: ``(hi0, lo0) = M0 * c0``, ``(hi1, lo1) = M1 * c2``, then
    ``c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)``; the key gains ``(W0, W1)`` (mod 2**32)
    before every round but the first."""
    ctr = [_split(w) if isinstance(w, int) else tuple(w) for w in counter]
    k0, k1 = int(key[0]) & 0xFFFFFFFF, int(key[1]) & 0xFFFFFFFF
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + PHILOX_W[0]) & 0xFFFFFFFF, (k1 + PHILOX_W[1]) & 0xFFFFFFFF
        hi0, lo0 = _mulhilo(xp, PHILOX_M[0], ctr[0])
        hi1, lo1 = _mulhilo(xp, PHILOX_M[1], ctr[2])
        ctr = [_xor(_xor(hi1, ctr[1]), _split(k0)), lo1, _xor(_xor(hi0, ctr[3]), _split(k1)), lo0]
    return ctr


def _limbs(xp: Any, host_words: Any, device: Any) -> Word:
    """A host array of uint32 values (NumPy, int64 or uint32) as ``(lo, hi)`` int32 limbs on ``device``."""
    import numpy as np

    w = np.asarray(host_words, dtype=np.int64) & 0xFFFFFFFF
    return (xp.asarray((w & _MASK16).astype(np.int32), device=device),
            xp.asarray((w >> 16).astype(np.int32), device=device))


def counters(xp: Any, rows: Any, step: int, dim: int, device: Any = None) -> tuple[Word, Word, Word, Word]:
    """The counter words of :func:`random_words` on ``device``, each ``[n, ceil(dim / 4)]``
    limbs made on the host from the int64 ids ``rows``: ``(column group, row mod 2**32,
    row // 2**32, step mod 2**32)``. Full arrays, not broadcasts: a compiler then takes them
    as inputs (XLA:CPU ran 10 rounds fed by broadcasts over 1000× slower)."""
    import numpy as np

    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 1)
    groups = -(-int(dim) // 4)
    shape = (rows.shape[0], groups)
    # each word's limbs made on its row or column and only then spread to the full shape (no
    # [n, groups] int64 arrays: a third of the host memory, W1's 29,800 rows x 16 groups)
    parts = [np.arange(groups, dtype=np.int64).reshape(1, -1), rows & 0xFFFFFFFF, rows >> 32,
             np.full((1, 1), int(step) & 0xFFFFFFFF, np.int64)]
    return tuple(_full_limbs(xp, c, shape, device) for c in parts)  # type: ignore[return-value]


def _full_limbs(xp: Any, host_words: Any, shape: tuple[int, int], device: Any) -> Word:
    """:func:`_limbs` of ``host_words`` broadcast to ``shape`` (full arrays, not broadcasts)."""
    import numpy as np

    w = np.asarray(host_words, dtype=np.int64) & 0xFFFFFFFF
    lo, hi = (w & _MASK16).astype(np.int32), (w >> 16).astype(np.int32)
    return (xp.asarray(np.ascontiguousarray(np.broadcast_to(lo, shape)), device=device),
            xp.asarray(np.ascontiguousarray(np.broadcast_to(hi, shape)), device=device))


def philox_words(xp: Any, seed: int, stream: int, ctr: Sequence[Word]) -> list[Array]:
    """The four Philox words of the :func:`counters` ``ctr`` under the key ``(seed, stream)``,
    each as its low 31 bits (non-negative int32, ``[n, groups]``)."""
    words = philox4x32(xp, ctr, (int(seed), int(stream)))
    return [xp.bitwise_and(hi, 0x7FFF) * 65536 + lo for lo, hi in words]  # hi's low 15 bits above lo


def interleave(xp: Any, words: Sequence[Array], dim: int) -> Array:
    """``[n, dim]``: column ``j`` from word ``j % 4`` of group ``j // 4``."""
    n, groups = (int(d) for d in words[0].shape)
    out = xp.reshape(xp.stack(list(words), axis=-1), (n, 4 * groups))
    return out if 4 * groups == dim else out[:, :dim]


def words_for(xp: Any, seed: int, stream: int, ctr: Sequence[Word], dim: int) -> Array:
    """:func:`random_words` from the :func:`counters` ``ctr``: ``[n, dim]``."""
    return interleave(xp, philox_words(xp, seed, stream, ctr), dim)


def _device(x: Array) -> Any:
    import array_api_compat

    return array_api_compat.device(x)


def random_words(xp: Any, seed: int, stream: int, step: int, rows: Any, dim: int, device: Any = None) -> Array:
    """``[len(rows), dim]`` int32 array of 31-bit random integers (the low 31 bits of Philox
    words): the random bits of :func:`round_bits` for the rows ``rows`` (host int64 ids) of one
    array at one step.

    Value ``(i, j)`` is word ``j % 4`` of ``philox4x32(counter=(j // 4, row mod 2**32,
    row // 2**32, step mod 2**32), key=(seed mod 2**32, stream mod 2**32))`` for ``row =
    rows[i]``; ``stream`` tells the table and array apart (:func:`stream_of` in
    ``meshembed.embedding.precision``)."""
    return words_for(xp, seed, stream, counters(xp, rows, step, dim, device), dim)


# -- rounding --------------------------------------------------------------------------------
def _check(dtype: str, rounding: str) -> None:
    if dtype not in LOW_PRECISION:
        raise ValueError(f"Invalid `dtype`. Expected one of {list(LOW_PRECISION)}. Received: dtype={dtype!r}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"Invalid `rounding`. Expected one of {list(ROUNDINGS)}. Received: rounding={rounding!r}")


def round_bits(xp: Any, bits: Array, dtype: str, rounding: str = "nearest", random: Array | None = None) -> Array:
    """float32 bit patterns (an int32 array) -> the ``dtype`` patterns (an int16 array).

    ``rounding="nearest"``: to nearest, ties to even (IEEE 754). ``"stochastic"``: ``random``
    (non-negative int32, at least 30 random low bits: :func:`random_words`) supplies a uniform
    integer below the dropped bits, which is added to the magnitude before truncation, so a
    value rounds up with probability equal to its distance from the value below, in ulps.
    The sign is kept; NaN stays NaN (made quiet); overflow gives ±inf; see
    docs/low_precision.md for every case."""
    _check(dtype, rounding)
    stochastic = rounding == "stochastic"
    if stochastic and random is None:
        raise ValueError("stochastic rounding needs `random` (meshembed.math.rounding.random_words)")
    negative = bits < 0
    mag = xp.bitwise_and(bits, 0x7FFFFFFF)
    nan = mag > 0x7F800000
    zero = xp.zeros_like(mag)
    m = xp.where(nan, zero, mag)  # NaN payloads out of the arithmetic (they could overflow int32)
    if dtype == "bfloat16":
        if stochastic:
            add = xp.bitwise_and(random, _MASK16)
        else:
            add = 0x7FFF + xp.bitwise_and(xp.bitwise_right_shift(m, 16), 1)
        h = xp.bitwise_right_shift(m + add, 16)  # a carry into the exponent is right (up to inf)
        h = xp.where(nan, xp.bitwise_or(xp.bitwise_right_shift(mag, 16), 0x0040), h)
    else:
        e = xp.bitwise_right_shift(m, 23)
        normal = e >= 113  # float16's normal range and above: the low 13 bits go
        base = xp.where(normal, m - (112 << 23), zero)  # exponent rebased to float16's bias
        if stochastic:
            add = xp.bitwise_and(random, 0x1FFF)
        else:
            add = 0xFFF + xp.bitwise_and(xp.bitwise_right_shift(base, 13), 1)
        hn = xp.minimum(xp.bitwise_right_shift(base + add, 13), xp.full_like(m, 0x7C00))  # overflow: inf
        # below 2**-14: float16 subnormals, in units of 2**-24; t = bits dropped from the
        # float32 significand (with its implicit bit)
        sig = xp.where(e > 0, xp.bitwise_or(xp.bitwise_and(m, 0x7FFFFF), 0x800000), xp.bitwise_and(m, 0x7FFFFF))
        t = xp.clip(126 - xp.maximum(e, xp.ones_like(e)), 1, 125)
        if stochastic:
            k = xp.minimum(t, xp.full_like(t, 30))  # at most 30 random bits (the sum stays < 2**31)
            pre = xp.bitwise_right_shift(sig, xp.minimum(t - k, xp.full_like(t, 31)))
            r = xp.bitwise_and(random, xp.bitwise_left_shift(xp.ones_like(k), k) - 1)
            hs = xp.bitwise_right_shift(pre + r, k)
        else:
            tc = xp.minimum(t, xp.full_like(t, 25))  # from 25 dropped bits on, every value rounds to 0
            lsb = xp.bitwise_and(xp.bitwise_right_shift(sig, tc), 1)
            half = xp.bitwise_left_shift(xp.ones_like(tc), tc - 1)
            hs = xp.bitwise_right_shift(sig + half - 1 + lsb, tc)
        h = xp.where(normal, hn, hs)
        quiet_nan = xp.bitwise_or(xp.bitwise_and(xp.bitwise_right_shift(mag, 13), 0x3FF), 0x7E00)
        h = xp.where(nan, quiet_nan, h)
    # the sign bit as int16's two's complement: pattern h | 0x8000 is h - 32768
    signed = xp.where(negative, h - 32768, h)
    return xp.astype(signed, xp.int16)


def widen_bits(xp: Any, half: Array, dtype: str) -> Array:
    """16-bit patterns (an int16 array) -> the float32 bit patterns (int32) of the same value:
    exact for every pattern (NaN payloads kept, float16 subnormals normalised)."""
    _check(dtype, "nearest")
    x = xp.astype(half, xp.int32)
    if dtype == "bfloat16":
        return x * 65536  # bits << 16, as a signed product that fits int32
    u = xp.bitwise_and(x, _MASK16)
    sign = xp.bitwise_right_shift(u, 15)
    e = xp.bitwise_and(xp.bitwise_right_shift(u, 10), 0x1F)
    m = xp.bitwise_and(u, 0x3FF)
    normal = (e + 112) * (1 << 23) + m * (1 << 13)
    special = 0x7F800000 + m * (1 << 13)  # inf (m == 0) and NaN (payload kept)
    # subnormal m * 2**-24: normalise by the position p of m's highest bit
    p = xp.zeros_like(m)
    for j in range(1, 10):
        p = p + xp.astype(m >= (1 << j), xp.int32)
    shifted = xp.bitwise_left_shift(m, 23 - p)
    sub = xp.where(m > 0, (p + 103) * (1 << 23) + xp.bitwise_and(shifted, 0x7FFFFF), xp.zeros_like(m))
    mag = xp.where(e == 0, sub, xp.where(e == 31, special, normal))
    return xp.where(sign == 1, mag + _INT32_MIN, mag)


# -- a table's arrays (backend rows; the backend's ``xp`` and ``bitcast``) -----------------------
def stream_of(table_index: int, array_index: int) -> int:
    """The second key word of an array's random bits: ``table_index * 256 + array_index``
    (array 0 = parameters, k = the k-th slot)."""
    return int(table_index) * 256 + int(array_index)


def widen(backend: Any, rows: Any, dtype: str) -> Any:
    """Stored rows (a backend int16 array) -> float32 rows (exact)."""
    if dtype == "float32":
        return rows
    return backend.bitcast(widen_bits(backend.xp, rows, dtype), "float32")


def narrow(backend: Any, values: Any, dtype: str, rounding: str, random: Any = None) -> Any:
    """float32 rows -> stored rows of ``dtype`` (int16), rounded as ``rounding`` says."""
    bits = backend.bitcast(backend.xp.astype(values, backend.xp.float32), "int32")
    return round_bits(backend.xp, bits, dtype, rounding, random)
