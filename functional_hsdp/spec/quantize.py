"""The compression policy of an outer reduction, and its codec: values to wire bytes and back.

A :class:`Compress` is a frozen policy (as FSDP2's ``MixedPrecisionPolicy``): the wire
format, the block of elements that shares one fp32 scale, and whether the rounding error is
fed back. Its codec (:meth:`Compress.encode`, :meth:`Compress.decode`) turns fp32 values into
the bytes that travel, and back; the formats, the rounding and the encoded form are in
:class:`Compress`'s docstring. A NaN or Inf poisons its whole block, never a silent zero.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import einops
import torch

from ..base.cache import lru

__all__ = ["Compress", "compress"]

#: format -> the largest value a scaled block uses (None: no scale, a plain cast)
_LARGEST: dict[Any, float | None] = {
    torch.bfloat16: None,
    torch.float8_e4m3fn: 448.0,
    torch.int8: 127.0,
    "int4": 7.0,
}


@dataclass(frozen=True)
class Compress:
    """How an outer reduction is compressed (made by :func:`compress`).

    Attributes:
        dtype: the wire format: ``torch.bfloat16``, ``torch.float8_e4m3fn``, ``torch.int8``
            or ``"int4"``.
        block: elements sharing one fp32 absmax scale (unused by bf16).
        error_feedback: whether each rank keeps what rounding lost (both legs) and adds it
            to the next reduction of the same buffer.

    The codec turns fp32 values into the bytes that travel, and back:

    ==================  ======================  =====================  ==================
    format              value bytes             scale per block        largest value
    ==================  ======================  =====================  ==================
    ``torch.bfloat16``  2 per value             none (plain cast)      (bf16's own)
    ``float8_e4m3fn``   1 per value             fp32 absmax / 448      448
    ``torch.int8``      1 per value             fp32 absmax / 127      127
    ``"int4"``          1 per two values        fp32 absmax / 7        7
    ==================  ======================  =====================  ==================

    Values are rounded to nearest (int: ties to even, as ``torch.round``; fp8/bf16: the
    cast's round to nearest even). A block whose values are all zero has scale 0 and decodes
    to zeros. A NaN or Inf poisons its whole block: the block's scale is NaN/Inf, so it decodes
    to NaN, never to a silent zero (``reduce_grads(..., check_finite=True)`` raises before any
    collective instead).

    The encoded form of ``n`` values is one uint8 row: the values' bytes (int4: padded to an
    even count), then the ``ceil(n / block)`` blocks' scales as fp32 bytes (the last block may
    be short).
    """

    dtype: Any
    block: int = 256
    error_feedback: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in _LARGEST:
            raise ValueError(
                f"compress: dtype must be one of torch.bfloat16, torch.float8_e4m3fn, "
                f"torch.int8 or 'int4'; got {self.dtype!r}"
            )
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"compress: block must be an int >= 1; got {self.block!r}")
        if not isinstance(self.error_feedback, bool):
            raise TypeError(f"compress: error_feedback must be a bool; got {self.error_feedback!r}")

    def __repr__(self) -> str:
        name = self.dtype if isinstance(self.dtype, str) else str(self.dtype).removeprefix("torch.")
        return f"compress({name}, block={self.block}, error_feedback={self.error_feedback})"

    @property
    def wire(self) -> torch.dtype:
        """The dtype the values travel in, as ``comm_log`` reports it (int4: ``torch.uint8``,
        two values a byte)."""
        return torch.uint8 if self.dtype == "int4" else self.dtype

    @property
    def scaled(self) -> bool:
        """Whether values travel with per-block scales (every format but bf16)."""
        return _LARGEST[self.dtype] is not None

    def nbytes(self, n: int) -> int:
        """Bytes of the encoded form of ``n`` values (scales included)."""
        if not self.scaled:
            return 2 * n
        values = -(-n // 2) if self.dtype == "int4" else n
        return values + 4 * -(-n // self.block)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (``(..., n)``, floating) -> its encoded bytes, ``(..., nbytes(n))`` uint8.

        Example:
            >>> import torch, functional_hsdp as fh
            >>> c = fh.compress(torch.int8, block=4)
            >>> x = torch.tensor([0.5, -1.0, 0.25, 0.0, 0.0, 0.0])
            >>> c.encode(x).shape, c.decode(c.encode(x), 6)
            (torch.Size([14]), tensor([ 0.5039, -1.0000,  0.2520,  0.0000,  0.0000,  0.0000]))
        """
        return self._code(x, keep=False)[0]

    @torch.no_grad()
    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        """Encoded bytes ``(..., nbytes(n))`` -> the ``n`` values they hold, fp32."""
        if not self.scaled:
            return _view(data, torch.bfloat16)[..., :n].float()
        blocks = -(-n // self.block)
        values = self.nbytes(n) - 4 * blocks
        scale = _view(data[..., values:], torch.float32)
        q = data[..., :values]
        if self.dtype == torch.int8:
            out = q.view(torch.int8).float()
        else:  # a byte's value(s) looked up: fp8's cast to fp32 is slow on a CPU
            out = _lookup(self.dtype, q)[..., :n]
        return _per_block(torch.mul, out, scale, block=self.block, out=out)

    def code(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``encode(x)``, what it decodes to, fp32): the sender's own rounding, for error
        feedback, without decoding the bytes again. ``x`` is not modified; both results are
        new tensors (the caller may overwrite the second)."""
        return self._code(x, keep=True)

    @torch.no_grad()
    def _code(self, x: torch.Tensor, *, keep: bool) -> tuple[torch.Tensor, Any]:
        """(bytes, what they decode to if ``keep`` else None)."""
        x = x.float()
        if not self.scaled:
            q = x.to(torch.bfloat16).contiguous()
            return q.view(torch.uint8), (q.float() if keep else None)
        largest = _LARGEST[self.dtype]
        scale = _absmax(x, self.block) / largest
        # one fp32 buffer, reused: x / scale, then the rounded values, then approx
        y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        _per_block(torch.div, x, torch.where(scale == 0, 1.0, scale), block=self.block, out=y)
        data = torch.empty(
            (*x.shape[:-1], self.nbytes(x.shape[-1])), dtype=torch.uint8, device=x.device
        )
        values = data.shape[-1] - 4 * scale.shape[-1]
        self._round(y, data[..., :values], clamp=_may_exceed(scale), keep=keep)
        data[..., values:] = scale.view(torch.uint8)
        if not keep:
            return data, None
        return data, _per_block(torch.mul, y, scale, block=self.block, out=y)

    def _round(self, y: torch.Tensor, raw: torch.Tensor, *, clamp: bool, keep: bool) -> None:
        """``y``, values over their block's scale -> their bytes in ``raw``; if ``keep``,
        ``y`` becomes the values the bytes hold (before the scale). ``clamp``: whether a
        value may lie beyond the format's largest (see :func:`_may_exceed`)."""
        largest = _LARGEST[self.dtype]
        if self.dtype == torch.float8_e4m3fn:
            if clamp:
                y.clamp_(-largest, largest)
            raw.view(torch.float8_e4m3fn).copy_(y)  # the cast rounds to nearest even
            if keep:
                table = _table(self.dtype, y.device)
                torch.index_select(table, 0, raw.int().view(-1), out=y.view(-1))
            return
        y.round_()
        if clamp:
            y.clamp_(-largest, largest)
        if self.dtype == torch.int8:
            raw.view(torch.int8).copy_(y)
            return
        # int4: offset by 8 into a nibble, two a byte (low nibble first; an odd count padded
        # with the nibble of 0)
        n = y.shape[-1]
        nib = torch.empty((*y.shape[:-1], n + n % 2), dtype=torch.uint8, device=y.device)
        nib[..., :n].view(torch.int8).copy_(y)
        nib[..., n:] = 0
        nib += 8
        if sys.byteorder == "little":  # a pair of nibbles read as one int16: lo + 256 * hi
            pair = nib.view(torch.int16)
            raw.copy_(pair | (pair >> 4))  # low byte: lo | hi << 4 (the int16 -> uint8 wraps)
        else:
            torch.bitwise_or(nib[..., 0::2], nib[..., 1::2] << 4, out=raw)


def _absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each block's largest magnitude, ``(..., ceil(n / block))``: the larger of its max and
    minus its min (two reads, no ``|x|`` written), ``+0.0`` so that a block of zeros gives
    +0. A NaN propagates, and an Inf makes it Inf: either way the block decodes to NaN
    (``0 * Inf``, ``NaN * q``), never to a silent zero."""
    main, tail = _blocks(x, block)
    top = torch.maximum(main.amax(-1), main.amin(-1).neg_())
    if tail is not None:
        last = torch.maximum(tail.amax(-1, keepdim=True), tail.amin(-1, keepdim=True).neg_())
        top = torch.cat([top, last], -1)
    return top.add_(0.0)


def _may_exceed(scale: torch.Tensor) -> bool:
    """Whether ``x / scale`` may exceed the format's largest value in a block, so that the
    rounded values need a clamp. With a normal fp32 scale (``absmax / largest`` rounded, at
    most 2^-24 off) it stays within ``largest * (1 + 2^-23)``, which rounds to ``largest``
    (int: below ``largest + 0.5``; e4m3: below 464); a subnormal scale is coarser. Off the
    CPU the answer is yes without looking (no host sync for a saved pass)."""
    if scale.device.type != "cpu":
        return True
    tiny = torch.finfo(torch.float32).tiny
    return bool(((scale > 0) & (scale < tiny)).any())


@lru(maxsize=16)
def _table(dtype: Any, device: torch.device) -> torch.Tensor:
    """Byte -> the fp32 value(s) it encodes: fp8 e4m3, ``(256,)`` fp32 (what the cast gives,
    NaN included); int4, ``(256,)`` int64, each the bytes of two fp32 (low nibble, high
    nibble, each minus 8): one 8-byte element a byte, so the lookup is a 1-D gather."""
    byte = torch.arange(256, device=device)
    if dtype == torch.float8_e4m3fn:
        return byte.to(torch.uint8).view(torch.float8_e4m3fn).float()
    pairs = torch.stack([byte & 15, byte >> 4], -1).float() - 8
    return pairs.view(torch.int64).view(-1)


def _lookup(dtype: Any, q: torch.Tensor) -> torch.Tensor:
    """Bytes ``q`` (``(..., m)`` uint8) -> the fp32 values they encode (fp8: ``(..., m)``;
    int4: ``(..., 2m)``), a new contiguous tensor."""
    out = _table(dtype, q.device).index_select(0, q.int().view(-1))
    return out.view(torch.float32).view(*q.shape[:-1], -1)


def _blocks(t: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Views of ``t`` (``(..., n)``, unit stride last): its whole blocks ``(..., n // block,
    block)`` and the short last block ``(..., n % block)`` (None if there is none)."""
    n = t.shape[-1]
    whole = n - n % block
    main = einops.rearrange(t[..., :whole], "... (k b) -> ... k b", b=block)
    return main, (t[..., whole:] if whole < n else None)


def _per_block(op: Any, t: torch.Tensor, scale: torch.Tensor, *, block: int, out: torch.Tensor):
    """``out = op(t, the scale of each element's block)``, block by block, into ``out`` (unit
    stride last; may be ``t``): no padding, no copy."""
    (t_main, t_tail), (o_main, o_tail) = _blocks(t, block), _blocks(out, block)
    k = t_main.shape[-2]
    op(t_main, scale[..., :k, None], out=o_main)
    if t_tail is not None:
        op(t_tail, scale[..., k:], out=o_tail)
    return out


def _view(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes ``data`` read as ``dtype`` (a copy where they do not start on its alignment)."""
    if not data.is_contiguous() or data.storage_offset() % dtype.itemsize:
        data = data.clone(memory_format=torch.contiguous_format)
    return data.view(dtype)


def compress(dtype: Any, *, block: int = 256, error_feedback: bool = True) -> Compress:
    """A compression policy for an outer reduction (``fh.hsdp(..., outer_compress=...)``,
    ``fh.diloco(..., compress=...)``, :func:`compressed_all_reduce`).

    Each rank quantizes its contribution, an all-to-all moves the pieces, each rank sums its
    piece in fp32 and quantizes the sum, and an all-gather returns it: no sum is taken in low
    precision. Scaled formats carry one fp32 scale per ``block`` elements (the block's absmax
    over the format's largest value: 127 for int8, 448 for e4m3, 7 for int4).

    Args:
        dtype: ``torch.bfloat16`` (0.5x fp32's bytes), ``torch.float8_e4m3fn`` or
            ``torch.int8`` (about 0.254x with block 256), or ``"int4"`` (two values a byte,
            about 0.129x).
        block: elements per fp32 scale, an int >= 1 (default 256).
        error_feedback: keep each rank's rounding loss (both legs) as a residual added into
            the next reduction of the same buffer (default True); the residual is state the
            caller holds (``reduce_grads``'s ``residual=``, :class:`MainGrad`,
            ``DiLoCoState.residual``).

    Returns:
        A frozen :class:`Compress`.

    References:
        Wang et al., ZeRO++ (arXiv 2306.10209): qgZ, a quantized all-to-all reduce-scatter.
        Seide et al., 1-bit SGD (2014) and Karimireddy et al. (2019): error feedback.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> fh.compress(torch.int8)
        compress(int8, block=256, error_feedback=True)
        >>> round(fh.compress("int4").nbytes(1024) / (4 * 1024), 3)
        0.129
    """
    return Compress(dtype, block=block, error_feedback=error_feedback)
