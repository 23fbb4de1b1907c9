"""The compression policy of an outer reduction, and its codec: values to wire bytes and back.

A :class:`Compress` is a frozen policy (as FSDP2's ``MixedPrecisionPolicy``): the wire
format, the block of elements that shares one fp32 scale, and whether the rounding error is
fed back. Its codec turns fp32 values into the bytes that travel, and back:

==================  ======================  =====================  ==================
format              value bytes             scale per block        largest value
==================  ======================  =====================  ==================
``torch.bfloat16``  2 per value             none (plain cast)      (bf16's own)
``float8_e4m3fn``   1 per value             fp32 absmax / 448      448
``torch.int8``      1 per value             fp32 absmax / 127      127
``"int4"``          1 per two values        fp32 absmax / 7        7
==================  ======================  =====================  ==================

Values are rounded to nearest (int: half away from even as ``torch.round``, fp8/bf16: the
cast's round to nearest even). A block whose values are all zero has scale 0 and decodes to
zeros. A NaN or Inf poisons its whole block: the block's scale is NaN/Inf, so it decodes to
NaN, never to a silent zero (``reduce_grads(..., check_finite=True)`` raises before any
collective instead).

The encoded form of ``n`` values is one uint8 row: the values' bytes (int4: padded to an even
count), then the ``ceil(n / block)`` blocks' scales as fp32 bytes (the last block may be
short).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

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
        return self.code(x)[0]

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        """Encoded bytes ``(..., nbytes(n))`` -> the ``n`` values they hold, fp32."""
        if not self.scaled:
            return _view(data, torch.bfloat16)[..., :n].float()
        blocks = -(-n // self.block)
        values = self.nbytes(n) - 4 * blocks
        scale = _view(data[..., values:], torch.float32)
        q = data[..., :values]
        if self.dtype == "int4":
            q = torch.stack([q & 15, q >> 4], -1).flatten(-2)[..., :n].to(torch.float32) - 8
        elif self.dtype == torch.int8:
            q = _view(q, torch.int8).to(torch.float32)
        else:
            q = _view(q, torch.float8_e4m3fn).to(torch.float32)
        q = torch.nn.functional.pad(q, (0, blocks * self.block - n))
        out = q.unflatten(-1, (blocks, self.block)) * scale[..., None]
        return out.flatten(-2)[..., :n]

    def code(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``encode(x)``, what it decodes to, fp32): the sender's own rounding, for error
        feedback, without decoding the bytes again."""
        x = x.float()
        n = x.shape[-1]
        if not self.scaled:
            q = x.to(torch.bfloat16).contiguous()
            return q.view(torch.uint8), q.float()
        largest = _LARGEST[self.dtype]
        blocks = -(-n // self.block)
        pad = blocks * self.block - n
        xb = torch.nn.functional.pad(x, (0, pad)).unflatten(-1, (blocks, self.block))
        # absmax propagates NaN, and an Inf makes the scale Inf: either way the block decodes
        # to NaN (0 * Inf, NaN * q), never to a silent zero
        scale = xb.abs().amax(-1) / largest
        y = xb / torch.where(scale == 0, 1.0, scale)[..., None]
        if self.dtype == torch.float8_e4m3fn:
            q = y.clamp(-largest, largest).to(torch.float8_e4m3fn)
            back = q.float()
            raw = q.view(torch.uint8).flatten(-2)[..., :n]
        else:
            back = y.round().clamp(-largest, largest)
            if self.dtype == torch.int8:
                raw = back.to(torch.int8).view(torch.uint8).flatten(-2)[..., :n]
            else:  # int4: offset by 8 into a nibble, two a byte (low nibble first)
                nib = (back + 8).to(torch.uint8).flatten(-2)[..., :n]
                if nib.shape[-1] % 2:
                    nib = torch.nn.functional.pad(nib, (0, 1), value=8)
                raw = nib[..., 0::2] | (nib[..., 1::2] << 4)
        approx = (back * scale[..., None]).flatten(-2)[..., :n]
        return torch.cat([raw, scale.contiguous().view(torch.uint8)], -1), approx


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
