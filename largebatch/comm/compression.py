"""Wire codecs: what travels between ranks, never what is accumulated.

``none`` sends the tensor's own dtype (no copy). ``fp16`` and ``bf16`` cast each
message to the 16-bit type before sending and add the received message into the
tensor in the tensor's own dtype, so partial sums are accumulated in fp32 (or
whatever the tensor is). To keep fp16 from overflowing, `largebatch.comm.allreduce`
divides the tensor by the world size before the first cast and multiplies by it
after the last (the DDP hook, which averages anyway, skips the multiply): the
reduced values then never exceed the largest input in magnitude. The price is
that values below about 6e-8 * world_size underflow to zero in fp16 (bf16 has
fp32's range and only loses mantissa).

The owner of a fully reduced piece rounds it through the wire format before it is
gathered (`Codec.round_`), so every rank ends with bit-identical values: DDP
replicas must not drift apart.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from largebatch.errors import UserError

WIRE_DTYPES: dict[str, Optional[torch.dtype]] = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Codec:
    """Encode/decode one message. ``wire`` is None for the lossless codec."""

    name: str
    wire: Optional[torch.dtype]

    @property
    def lossy(self) -> bool:
        return self.wire is not None

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype if self.wire is None else self.wire

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The message for ``x``: ``x`` itself when lossless, else ``x`` cast into ``out``."""
        if self.wire is None:
            return x
        out.copy_(x)
        return out

    def round_(self, x: torch.Tensor) -> None:
        """Round ``x`` in place through the wire format (no-op when lossless)."""
        if self.wire is not None and x.numel():
            x.copy_(x.to(self.wire))


def get_codec(name: str, dtype: torch.dtype | None = None) -> Codec:
    """The codec called ``name``; a lossy codec on a non-float tensor is a UserError."""
    if name not in WIRE_DTYPES:
        raise UserError(f"unknown compression {name!r}; choose one of: {', '.join(WIRE_DTYPES)}.")
    codec = Codec(name, WIRE_DTYPES[name])
    if codec.lossy and dtype is not None and not dtype.is_floating_point:
        raise UserError(f"compression {name} applies to floating-point tensors, not {dtype}; "
                        f"use compression='none' for integer tensors.")
    return codec
