"""Quantization: the schemes, the packed formats and their torch reference.

Weight-only schemes (activations and the KV cache stay in the engine dtype; only linear weights
shrink):

- `int8`: symmetric, one fp32 scale per output channel: w = scale[n] * q[n, k], q in [-127, 127].
- `int4` / `int4-g64`: asymmetric, groups of 32 (or 64) weights along the input dimension, fp16
  scale and min per group: w = fp32(d * q + m) rounded once (the kernels' FMA; exact in float64,
  where the torch reference computes it), q in [0, 15] (llama.cpp's Q4_1 grid, so a
  model converted from a Q4_1 GGUF is recovered exactly). The lm_head stays int8 under int4 (as
  llama.cpp keeps its output matrix at 6-8 bits): small models lose most of their 4-bit quality
  there, and it is one matrix.

Packed int4 layout (what the kernels read): each row is a run of 64-weight super-blocks of 32
bytes, read as 16 little-endian uint16 lanes; lane i holds weights i, 16+i, 32+i, 48+i of the
super-block in nibbles 0..3. A 16-lane vector load then yields four 16-weight chunks with one
shift each. Requires in_features % 64 == 0.

Activation-quantized schemes (W8A8: int8 arithmetic in the GEMMs): `int8-w8a8` uses
the `int8` weights, `int4-w4a8` the `int4` weights (their dequantized values requantized per
channel to int8 for the GEMM, so the int4 rounding is what the model computes with); every
linear's activations are quantized per token, dynamically, to int8 (`w8a8_reference`), and the
products accumulate in int32. `int8-w8a8`'s weights are quantized after SmoothQuant-style
smoothing (engine/quant_smooth.py: per-input-channel scales from a calibration pass, folded into
the norms and the v / up rows), so they are not the weight-only matrices and do not use their
cache; `int4-w4a8` keeps the int4 weights as they are (a 4-bit checkpoint's groups are recovered
exactly; smoothed and requantized they cost more than smoothing saves: quant_smooth.SCHEMES). The
lm_head keeps the weight-only int8 path (fp32 logits). The KV cache stays in the engine dtype. The
W8A8 kernels read the weights in a blocked layout (`pack_w8a8`).

Invariant: `dequantize(quantize(w))` is exactly what the kernels multiply by (int4: one FMA,
as the kernels build their lookup table; int8: q as fp32, the scale applied to the dot product).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCHEMES = ("int8", "int4", "int4-g64", "int8-w8a8", "int4-w4a8")
#: the weight format of each scheme (what is quantized, cached and packed)
WEIGHT_FORMAT = {
    "int8": "int8",
    "int4": "int4",
    "int4-g64": "int4-g64",
    "int8-w8a8": "int8",
    "int4-w4a8": "int4",
}
#: schemes whose linears quantize their activations to int8 (W8A8 GEMMs)
ACT_INT8 = frozenset({"int8-w8a8", "int4-w4a8"})
#: per W8A8 scheme, the linears ("qkv", "o", "gate_up", "down") whose activations get one int8
#: scale per group of this many inputs instead of one per token. down's input (silu(gate) * up)
#: holds outliers that move from token to token, so smoothing cannot fold them away
#: (engine/quant_smooth.py) and a per-token scale spends most of int8's range on them: on
#: SmolLM2-135M, int8-w8a8's perplexity vs bf16 (bench.quality, stdlib / passage) is +1.15 % /
#: +1.92 % with per-token scales for down, +0.52 % / +0.74 % with groups of 128, +0.87 % / +0.81 %
#: with 256 (Intel Xeon with AMX, 2026-12-02). 128 keeps a margin under the +1 % target; its
#: price is down's GEMM (a quarter of the linear FLOPs): each group's int32 sums are dequantized
#: on their own; with AMX that overlaps the next group's tdpbssd, ~1.25x down's ungrouped time at
#: 512 rows, ~1.4x at 32 (one row, VNNI: ~1.25x).
#: o (the attention output) joined on 2026-12-03: with the AMX prefill attention's rounding the
#: down-only setting read +0.91 % / +0.56 % (the margin was rounding luck); down and o at 128:
#: +0.73-0.77 % / +0.73-0.78 % (two runs), greedy sequences identical to bf16 0.44 (down only:
#: 0.25); o is ~7 % of the linear FLOPs, so its grouped GEMM costs ~1-2 % of a prefill.
ACT_GROUPS: dict[str, dict[str, int]] = {"int8-w8a8": {"down": 128, "o": 128}}
#: what each weight format quantizes the lm_head to (see the module docstring)
LM_HEAD_SCHEME = {"int8": "int8", "int4": "int8", "int4-g64": "int8"}


@dataclass(frozen=True)
class QuantizedWeight:
    """One quantized [out_features, in_features] matrix in its packed kernel format."""

    scheme: str  # "int8" | "int4"
    out_features: int
    in_features: int
    q: torch.Tensor  # int8 [N, K] | uint8 [N, K / 2] (packed, see module docstring)
    scales: torch.Tensor  # fp32 [N] | fp16 [N, K / group]
    mins: torch.Tensor | None = None  # fp16 [N, K / group] (int4)
    group: int = 0  # int4 group size

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self.q, self.scales, self.mins) if t is not None
        )

    @property
    def int4_mins(self) -> torch.Tensor:
        """An int4 weight's mins (an int8 weight has none)."""
        if self.mins is None:
            raise ValueError(f"an {self.scheme} weight has no mins")
        return self.mins

    def to(self, device: torch.device) -> QuantizedWeight:
        mins = None if self.mins is None else self.mins.to(device).contiguous()
        return QuantizedWeight(
            scheme=self.scheme,
            out_features=self.out_features,
            in_features=self.in_features,
            q=self.q.to(device).contiguous(),
            scales=self.scales.to(device).contiguous(),
            mins=mins,
            group=self.group,
        )


def check_scheme(name: str) -> str:
    if name not in SCHEMES:
        raise ValueError(
            f"unknown quantization {name!r}; use one of {', '.join(SCHEMES)} (or none)"
        )
    return name


def quantize(w: torch.Tensor, scheme: str) -> QuantizedWeight:
    """Quantize a [N, K] weight (any float dtype; computed in fp32) in `scheme`'s weight format."""
    scheme = WEIGHT_FORMAT[check_scheme(scheme)]
    if scheme == "int8":
        return quantize_int8(w)
    return quantize_int4(w, 64 if scheme == "int4-g64" else 32)


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    w = w.detach().float().cpu()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(
        scheme="int8",
        out_features=w.shape[0],
        in_features=w.shape[1],
        q=q.contiguous(),
        scales=scale.contiguous(),
    )


def quantize_int4(w: torch.Tensor, group: int = 32) -> QuantizedWeight:
    if group not in (32, 64):
        raise ValueError(f"int4 group size must be 32 or 64, not {group}")
    n, k = w.shape
    if k % 64:
        raise ValueError(f"int4 needs in_features divisible by 64; this matrix has {k}")
    g = w.detach().float().cpu().reshape(n * (k // group), group)
    d, m, q = _fit_int4(g)
    return QuantizedWeight(
        scheme="int4",
        out_features=n,
        in_features=k,
        q=pack_int4(q.reshape(n, k)),
        scales=d.reshape(n, k // group).contiguous(),
        mins=m.reshape(n, k // group).contiguous(),
        group=group,
    )


#: range shrink factors tried beyond min/max (the least-squares refit after each can widen again)
_SHRINKS = (0.95, 0.9, 0.85, 0.8, 0.75)


def _fit_int4(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp16 d, m and q in 0..15 per row of `g` [groups, group], minimizing the squared error.

    Starts from min/max (Q4_1's choice, exact for weights already on such a grid), then tries
    narrower ranges, each followed by a least-squares refit of d and m to its rounded q (in the
    spirit of llama.cpp's k-quants): a narrower range trades clipping of the extremes for a finer
    step everywhere else. A candidate replaces the best only when strictly better, so a grid that
    min/max reproduces exactly stays exact.
    """
    lo, hi = g.amin(dim=1, keepdim=True), g.amax(dim=1, keepdim=True)
    best = _candidate(g, ((hi - lo) / 15.0).half(), lo.half())
    for t in _SHRINKS:
        if not bool((best[3] > 0).any()):
            break  # every group is exact already (weights from a Q4_1 GGUF): nothing to search
        span = (hi - lo) * t
        d0, m0 = (span / 15.0).half(), (lo + (hi - lo - span) / 2).half()
        q = _round_q(g, d0, m0).float()
        n = g.shape[1]
        sq, sqq = q.sum(1, keepdim=True), (q * q).sum(1, keepdim=True)
        sw, sqw = g.sum(1, keepdim=True), (q * g).sum(1, keepdim=True)
        det = n * sqq - sq * sq
        ok = det > 0
        d1 = torch.where(
            ok, (n * sqw - sq * sw) / torch.where(ok, det, torch.ones_like(det)), d0.float()
        )
        m1 = torch.where(ok, (sw - d1 * sq) / n, m0.float())
        d1 = torch.where(d1 > 0, d1, d0.float())
        cand = _candidate(g, d1.half(), m1.half())
        better = cand[3] < best[3]
        best = tuple(torch.where(better, c, b) for c, b in zip(cand, best, strict=True))
    d, m, q, _ = best
    return d.squeeze(1), m.squeeze(1), q


def _round_q(g: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    df = d.float()
    safe = torch.where(df > 0, df, torch.ones_like(df))
    q = torch.round((g - m.float()) / safe).clamp_(0, 15)
    return torch.where(df > 0, q, torch.zeros_like(q)).to(torch.int32)


def _candidate(g: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
    """(d, m, q, squared error) of one choice of fp16 d and m, with w = fp32(d q + m) as it
    dequantizes."""
    if not torch.isfinite(d.float()).all() or not torch.isfinite(m.float()).all():
        d = torch.where(torch.isfinite(d), d, torch.zeros_like(d))
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    q = _round_q(g, d, m)
    w = (q.double() * d.double() + m.double()).float()
    return d, m, q, ((w - g) ** 2).sum(1, keepdim=True)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] ints in [0, 15] → uint8 [N, K / 2] in the super-block layout."""
    n, k = q.shape
    sb = q.to(torch.int32).reshape(n, k // 64, 4, 16)  # [.., nibble j, lane i] = weight 16 j + i
    lanes = (
        sb[:, :, 0] | (sb[:, :, 1] << 4) | (sb[:, :, 2] << 8) | (sb[:, :, 3] << 12)
    )  # [N, K/64, 16]
    lo, hi = lanes & 0xFF, lanes >> 8
    return torch.stack([lo, hi], dim=-1).to(torch.uint8).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of pack_int4: uint8 [N, K / 2] → int32 [N, K]."""
    n = packed.shape[0]
    b = packed.to(torch.int32).reshape(n, k // 64, 16, 2)
    lanes = b[..., 0] | (b[..., 1] << 8)  # [N, K/64, 16]
    nib = torch.stack([(lanes >> (4 * j)) & 0xF for j in range(4)], dim=2)  # [N, K/64, 4, 16]
    return nib.reshape(n, k)


def dequantize(qw: QuantizedWeight, rows: slice = slice(None)) -> torch.Tensor:
    """The fp32 weight the kernels compute with (optionally only some output rows)."""
    if qw.scheme == "int8":
        return qw.q[rows].float() * qw.scales[rows, None]
    q = unpack_int4(qw.q[rows], qw.in_features)
    n = q.shape[0]
    q = q.reshape(n, -1, qw.group).double()
    # d * q + m rounded once, like the kernels' FMA: the float64 result is exact (q has 4 bits,
    # d and m 11-bit fp16 significands within fp16's exponent range), so one rounding remains
    w = q * qw.scales[rows].double()[..., None] + qw.int4_mins[rows].double()[..., None]
    return w.float().reshape(n, qw.in_features)


def pack_w8a8(q: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] → (the W8A8 kernels' blocked layout, wsum int32 [groups * N]: per activation
    group of `group` inputs (0: one group), the sum over its k of q[n, k]).

    Layout (engine/kernels/qgemm_w8a8.c): N padded to a multiple of 32 and K to 64 with zeros;
    blocks of 16 rows, each [K / 4 quads][16 rows][4 bytes]: a 64-byte quad is one vpdpbusd
    operand and 16 quads one AMX B tile."""
    n, k = q.shape
    np_, kp = -(-n // 32) * 32, -(-k // 64) * 64
    padded = torch.zeros(np_, kp, dtype=torch.int8)
    padded[:n, :k] = q
    packed = padded.reshape(np_ // 16, 16, kp // 4, 4).permute(0, 2, 1, 3).contiguous()
    sums = [q[:, k0 : k0 + g].to(torch.int32).sum(dim=1) for k0, g in _groups(k, group)]
    return packed.reshape(-1), torch.cat(sums).to(torch.int32).contiguous()


def _groups(k: int, group: int) -> list[tuple[int, int]]:
    """(start, width) of each activation group of a k-input row (group 0 or >= k: the whole row)."""
    if group < 0 or group % 64:
        raise ValueError(f"an activation group is a positive multiple of 64 inputs, not {group}")
    g = k if group == 0 or group >= k else group
    return [(k0, min(g, k - k0)) for k0 in range(0, k, g)]


def int8_for_gemm(qw: QuantizedWeight) -> QuantizedWeight:
    """The int8 per-channel weight a W8A8 GEMM multiplies by: `qw` itself, or an int4 weight's
    dequantized values requantized (the int4 tier's rounding, then a finer per-channel grid)."""
    return qw if qw.scheme == "int8" else quantize_int8(dequantize(qw))


def quantize_activations(x: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic int8 (one scale per `group` inputs of a token with group > 0): (xq in
    [-127, 127] as fp32, sx fp32 [rows, groups]), in the kernels' fp32 arithmetic: inv = 127 /
    amax, xq = round-half-even(x * inv), sx = amax / 127."""
    xf = x.float()
    qs, ss = [], []
    for k0, g in _groups(xf.shape[-1], group):
        part = xf[..., k0 : k0 + g]
        amax = part.abs().amax(dim=-1, keepdim=True)
        c127 = torch.full_like(amax, 127.0)  # tensor / tensor: a true fp32 division, as in C (torch
        inv = torch.where(
            amax > 0, c127 / amax, torch.zeros_like(amax)
        )  # turns `127.0 / t` into 127 * (1 / t))
        qs.append(torch.round(part * inv).clamp_(-127, 127))
        ss.append(amax / c127)
    return torch.cat(qs, dim=-1), torch.cat(ss, dim=-1)


def w8a8_reference(
    x: torch.Tensor,
    qw: QuantizedWeight,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    group: int = 0,
) -> torch.Tensor:
    """The W8A8 linear in torch, bit for bit what the kernels compute: integer sums (exact in
    float64), ((float)acc * sx) * scale[n] — with activation groups, each group's
    (float)acc_g * sx_g added in fp32 in group order, then * scale[n] — plus the bias, one
    rounding to the output dtype."""
    xq, sx = quantize_activations(x, group)
    spans = _groups(x.shape[-1], group)
    if len(spans) == 1:
        out = ((xq.double() @ qw.q.double().T).float() * sx) * qw.scales
    else:
        tot = torch.zeros((*x.shape[:-1], qw.out_features), dtype=torch.float32)
        for j, (k0, g) in enumerate(spans):
            acc = (xq[..., k0 : k0 + g].double() @ qw.q[:, k0 : k0 + g].double().T).float()
            tot = tot + acc * sx[..., j : j + 1]
        out = tot * qw.scales
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or x.dtype)
