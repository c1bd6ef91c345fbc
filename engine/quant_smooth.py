"""SmoothQuant-style smoothing for the W8A8 schemes, applied to the full-precision
weights before they are quantized.

Per-token int8 activations lose most of their precision to a few input channels whose values are
far larger than the rest (the same channels in every token). Smoothing divides each input
channel j of a linear by s_j and multiplies the weight's column j by s_j — an exact
reparametrization in full precision — with s_j = amax|x_j|^alpha / amax|W[:, j]|^(1 - alpha)
(Xiao et al., SmoothQuant), so activations and weights share the range. The division is folded
into what produces the input, so it costs nothing at run time and no kernel changes:

- qkv's input: the layer's input RMSNorm weight (/ s);
- gate_up's input: the post-attention RMSNorm weight;
- o's input (the attention output): the rows of v (and v's bias) — attention output channel
  (head h, dim d) is a mix of v channel (kv head of h, d), so heads sharing a kv head share s;
- down's input (silu(gate) * up): the rows of up (available, not applied by default: SMOOTHED).

amax|x_j| comes from a calibration pass of the full-precision model, the engine's own forward in
fp32, over `engine/data/calibration_en.txt` (general English prose, dialogue, Q&A, a little code;
written for this purpose and disjoint from bench.quality's corpora); the first `SKIP` positions of
each window are left out (attention-sink tokens carry activations no later token has, and their
rows get their own per-token scale anyway).

Invariant: smoothing changes only the raw fp32 tensors handed to quantization; the weight-only
schemes never see it. For every linear, x_smoothed @ W_smoothed^T == x @ W^T in exact arithmetic.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from engine.model_config import ModelConfig

log = logging.getLogger("duet.engine.quant")

CALIBRATION = Path(__file__).parent / "data" / "calibration_en.txt"
#: migration strength: how much of an input channel's range moves into the weight (measured on
#: SmolLM2-135M with bench.quality: 0.25, 0.5, 0.75, 0.9; 0.75 best)
ALPHA = 0.75
#: positions at the start of each calibration window left out of the statistics
SKIP = 4
#: tokens per calibration forward pass
WINDOW = 512
PARTS = ("qkv", "o", "gate_up", "down")
#: the schemes whose weights are smoothed: int8-w8a8 only. int4-w4a8's int4 weights come from the
#: checkpoint's own 4-bit groups (SmolLM2's Q4_1 GGUF: exactly recovered); a per-column scale
#: folded in first breaks that, and the requantized int4 cost far more than smoothing saves
#: (SmolLM2 perplexity vs bf16: +2.7 % unsmoothed, +10.3 % smoothed, bench.quality on stdlib)
SCHEMES = frozenset({"int8-w8a8"})
#: the linears smoothed: down's input outliers vary from token to token (smoothing it helped one
#: corpus and hurt the other), so it is left as it is
SMOOTHED = frozenset({"qkv", "o", "gate_up"})


class _Recorder:
    """Wraps a linear layer: records the running per-input-channel amax of what it is fed."""

    def __init__(self, inner, skip_rows: list[int]) -> None:
        self.inner = inner
        self.skip_rows = skip_rows
        self.amax: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, *a, **kw) -> torch.Tensor:
        keep = torch.ones(x.shape[0], dtype=torch.bool)
        keep[[r for r in self.skip_rows if r < x.shape[0]]] = False
        m = x[keep].float().abs().amax(dim=0)
        self.amax = m if self.amax is None else torch.maximum(self.amax, m)
        return self.inner(x, *a, **kw)

    def recorded(self) -> torch.Tensor:
        """The amax over what the layer was fed (it must have been fed)."""
        if self.amax is None:
            raise ValueError(f"the calibration text must be longer than {SKIP} tokens")
        return self.amax


@torch.inference_mode()
def activation_ranges(
    model_dir: Path, cfg: ModelConfig, text: str | None = None
) -> list[dict[str, torch.Tensor]]:
    """Per layer, per linear ("qkv", "o", "gate_up", "down"): amax over calibration tokens of each
    input channel, from the unquantized model in fp32."""
    from engine.attention import build_metadata
    from engine.model import LlamaModel
    from engine.rope import Rope
    from engine.weights import load_weights
    from text.tokenizer import Tokenizer

    dev = torch.device("cpu")
    ids = Tokenizer(model_dir).encode(text if text is not None else CALIBRATION.read_text())
    weights = load_weights(Path(model_dir), cfg, torch.float32, dev, quantization=None)
    window = min(WINDOW, len(ids))
    model = LlamaModel(
        cfg,
        weights,
        Rope(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, window, torch.float32, dev),
        dev,
    )
    skip = list(range(SKIP))
    recs = []
    for layer in model.layers:
        recs.append({p: _Recorder(getattr(layer, p), skip) for p in PARTS})
        for p, r in recs[-1].items():
            setattr(layer, p, r)
    bs = 16
    blocks = list(range(-(-window // bs)))
    kv = torch.zeros(
        (len(blocks), cfg.num_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim), dtype=torch.float32
    )
    for start in range(0, len(ids), window):
        chunk = ids[start : start + window]
        if len(chunk) <= SKIP:
            break
        md = build_metadata(bs, [], [(blocks, 0, len(chunk))], cfg.sliding_window, dev)
        model.hidden_states(torch.tensor(chunk), kv, md, torch.tensor([len(chunk) - 1]))
    return [{p: r.recorded() for p, r in layer.items()} for layer in recs]


def _scales(a: torch.Tensor, w: torch.Tensor, alpha: float) -> torch.Tensor:
    a, w = a.clamp(min=1e-5), w.clamp(min=1e-5)
    return (a.pow(alpha) / w.pow(1 - alpha)).clamp(min=1e-5)


def smooth_raw(
    raw: dict[str, torch.Tensor],
    cfg: ModelConfig,
    ranges: list[dict[str, torch.Tensor]],
    root: str,
    alpha: float = ALPHA,
    parts: frozenset[str] = SMOOTHED,
) -> None:
    """Smooth the raw checkpoint tensors of `parts` in place (fp32 from here on); the module
    docstring says how."""
    nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    group = nh // nkv
    names = {
        "in_norm": "input_layernorm.weight",
        "post_norm": "post_attention_layernorm.weight",
        "q": "self_attn.q_proj.weight",
        "k": "self_attn.k_proj.weight",
        "v": "self_attn.v_proj.weight",
        "o": "self_attn.o_proj.weight",
        "gate": "mlp.gate_proj.weight",
        "up": "mlp.up_proj.weight",
        "down": "mlp.down_proj.weight",
    }
    for i, r in enumerate(ranges):
        p = f"{root}layers.{i}."
        f = {k: raw[p + n].float() for k, n in names.items()}
        if "qkv" in parts:
            s = _scales(r["qkv"], torch.cat([f["q"], f["k"], f["v"]]).abs().amax(dim=0), alpha)
            f["in_norm"] = f["in_norm"] / s
            for k in "qkv":
                f[k] = f[k] * s
        if "gate_up" in parts:
            s = _scales(r["gate_up"], torch.cat([f["gate"], f["up"]]).abs().amax(dim=0), alpha)
            f["post_norm"] = f["post_norm"] / s
            f["gate"], f["up"] = f["gate"] * s, f["up"] * s
        if "o" in parts:
            # one scale per (kv head, dim), shared by the q heads that read that kv head
            a = r["o"].reshape(nkv, group, d).amax(dim=1)
            w = f["o"].abs().amax(dim=0).reshape(nkv, group, d).amax(dim=1)
            s_kv = _scales(a, w, alpha)  # [nkv, d]
            f["o"] = f["o"] * s_kv[:, None, :].expand(nkv, group, d).reshape(1, nh * d)
            f["v"] = f["v"] / s_kv.reshape(nkv * d, 1)
            vb = p + "self_attn.v_proj.bias"
            if vb in raw:
                raw[vb] = raw[vb].float() / s_kv.reshape(nkv * d)
        if "down" in parts:
            # its input is silu(gate) * up: linear in up's rows
            s = _scales(r["down"], f["down"].abs().amax(dim=0), alpha)
            f["down"] = f["down"] * s
            f["up"] = f["up"] / s[:, None]
        for k, n in names.items():
            raw[p + n] = f[k]


def smooth_checkpoint(
    raw: dict[str, torch.Tensor], model_dir: Path, cfg: ModelConfig, root: str
) -> None:
    """Calibrate the model at `model_dir` and smooth `raw` (its tensors) in place."""
    t0 = time.monotonic()
    ranges = activation_ranges(model_dir, cfg)
    smooth_raw(raw, cfg, ranges, root)
    log.info(
        "W8A8 smoothing: calibrated on %s and smoothed %d layers in %.1f s",
        CALIBRATION.name,
        len(ranges),
        time.monotonic() - t0,
    )
