"""`sgl_kernel.scalar_type` of the check-only GPU stand-in: the bit layouts of quantized weight
types (the real module is pure Python, from vLLM). SGLang imports `ScalarType, scalar_types` at
module level on CUDA (layers/quantization/utils.py's get_scalar_types, GPTQ/AWQ/Marlin) and
reads constants such as `scalar_types.uint4b8` while importing; a bf16 Llama uses none of them.
Layout fields, `id`, `size_bits` and the integer predicates/bounds match the real module;
`min()`/`max()` of a floating-point type raise NotImplementedError (only Marlin kernels use them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class NanRepr(Enum):
    """How a floating-point type encodes NaN."""

    NONE = 0  # no NaNs
    IEEE_754 = 1  # exponent all ones, mantissa non-zero
    EXTD_RANGE_MAX_MIN = 2  # max/min bit patterns (e.g. float8_e4m3fn)


_BY_ID: dict[int, ScalarType] = {}


@dataclass(frozen=True)
class ScalarType:
    """A scalar layout: `exponent` and `mantissa` bits, sign bit, integer `bias`."""

    exponent: int
    mantissa: int
    signed: bool
    bias: int = 0
    _finite_values_only: bool = False
    nan_repr: NanRepr = NanRepr.IEEE_754
    id: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        val, offset = 0, 0
        for member, width in ((self.exponent, 8), (self.mantissa, 8), (self.signed, 1),
                              (self.bias, 32), (self._finite_values_only, 1),
                              (self.nan_repr.value, 8)):  # fmt: skip
            val |= (int(member) & ((1 << width) - 1)) << offset
            offset += width
        object.__setattr__(self, "id", val)
        _BY_ID.setdefault(val, self)

    @property
    def size_bits(self) -> int:
        return self.exponent + self.mantissa + int(self.signed)

    def is_signed(self) -> bool:
        return self.signed

    def is_floating_point(self) -> bool:
        return self.exponent != 0

    def is_integer(self) -> bool:
        return self.exponent == 0

    def has_bias(self) -> bool:
        return self.bias != 0

    def has_infs(self) -> bool:
        return not self._finite_values_only

    def has_nans(self) -> bool:
        return self.nan_repr != NanRepr.NONE

    def is_ieee_754(self) -> bool:
        return self.nan_repr == NanRepr.IEEE_754 and not self._finite_values_only

    def _int_bound(self, upper: bool) -> int:
        if self.is_floating_point():
            raise NotImplementedError(
                f"sgl_kernel.scalar_type: min()/max() of {self} are not implemented by the "
                "check-only GPU stand-in (scripts/gpu_standin)"
            )
        if self.signed:
            bound = (1 << self.mantissa) - 1 if upper else -(1 << self.mantissa)
        else:
            bound = (1 << self.mantissa) - 1 if upper else 0
        return bound - self.bias

    def max(self) -> int:
        """Largest value (integer types: the stored maximum less the bias)."""
        return self._int_bound(True)

    def min(self) -> int:
        """Smallest value (integer types: the stored minimum less the bias)."""
        return self._int_bound(False)

    def __str__(self) -> str:
        if self.is_floating_point():
            name = f"float{self.size_bits}_e{self.exponent}m{self.mantissa}"
            if not self.is_ieee_754():
                name += "f" if self._finite_values_only else ""
                name += "n" if self.nan_repr != NanRepr.NONE else ""
            return name
        name = ("int" if self.signed else "uint") + str(self.size_bits)
        return name + (f"b{self.bias}" if self.has_bias() else "")

    @classmethod
    def int_(cls, size_bits: int, bias: int | None) -> ScalarType:
        return cls(0, size_bits - 1, True, bias or 0)

    @classmethod
    def uint(cls, size_bits: int, bias: int | None) -> ScalarType:
        return cls(0, size_bits, False, bias or 0)

    @classmethod
    def float_IEEE754(cls, exponent: int, mantissa: int) -> ScalarType:
        return cls(exponent, mantissa, True, 0, False, NanRepr.IEEE_754)

    @classmethod
    def float_(
        cls, exponent: int, mantissa: int, finite_values_only: bool, nan_repr: NanRepr
    ) -> ScalarType:
        return cls(exponent, mantissa, True, 0, finite_values_only, nan_repr)

    @classmethod
    def from_id(cls, scalar_type_id: int) -> ScalarType:
        if scalar_type_id not in _BY_ID:
            raise ValueError(f"scalar_type_id {scalar_type_id} doesn't exist.")
        return _BY_ID[scalar_type_id]


class scalar_types:
    """The named layouts of the real module."""

    int4 = ScalarType.int_(4, None)
    uint4 = ScalarType.uint(4, None)
    int8 = ScalarType.int_(8, None)
    uint8 = ScalarType.uint(8, None)
    float8_e4m3fn = ScalarType.float_(4, 3, True, NanRepr.EXTD_RANGE_MAX_MIN)
    float8_e5m2 = ScalarType.float_IEEE754(5, 2)
    float8_e8m0fnu = ScalarType(8, 0, False, 0, True, NanRepr.EXTD_RANGE_MAX_MIN)
    float16_e8m7 = ScalarType.float_IEEE754(8, 7)
    float16_e5m10 = ScalarType.float_IEEE754(5, 10)
    float6_e3m2f = ScalarType.float_(3, 2, True, NanRepr.NONE)
    float4_e2m1f = ScalarType.float_(2, 1, True, NanRepr.NONE)
    uint2b2 = ScalarType.uint(2, 2)
    uint3b4 = ScalarType.uint(3, 4)
    uint4b8 = ScalarType.uint(4, 8)
    uint8b128 = ScalarType.uint(8, 128)
    bfloat16 = float16_e8m7
    float16 = float16_e5m10
