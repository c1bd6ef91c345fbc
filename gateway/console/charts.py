"""Charts as inline SVG, drawn on the server: no chart library, no CDN, nothing to vendor or
keep patched, and nothing a strict CSP must allow (no script builds them; the colours are SVG
presentation attributes, not inline CSS). Each chart is `role="img"` with a title and a
description, and its numbers are also in the table beside it, for screen readers.

- `bars`: one value per label (a day's tokens, $, requests);
- `lines`: a few series over the same labels (TTFT P50 and P90);
- `timeline`: one trace's spans as a waterfall (depth = indentation).
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.console.render import esc

W, H, PAD_L, PAD_B, PAD_T = 460, 200, 64, 40, 18
#: the trace timeline's width
TW = 900
#: 4.5:1 or better against the white background (WCAG AA)
COLOURS = ("#1f5fa8", "#a3361c", "#2d6a2d", "#6b3fa0")


def _fmt(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:.1f}M"
    if v >= 1e3:
        return f"{v / 1e3:.1f}k"
    return f"{v:.4g}"


def _frame(title: str, desc: str, inner: str, height: int = H, width: int = W) -> str:
    return (
        f'<figure><svg viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        f'aria-label="{esc(title)}" xmlns="http://www.w3.org/2000/svg"><title>{esc(title)}</title>'
        f"<desc>{esc(desc)}</desc>{inner}</svg><figcaption>{esc(title)}</figcaption></figure>"
    )


def _axes(top: float, labels: Sequence[str]) -> str:
    plot_w, plot_h = W - PAD_L - 8, H - PAD_B - PAD_T
    out = [
        f'<line x1="{PAD_L}" y1="{H - PAD_B}" x2="{W - 8}" y2="{H - PAD_B}" stroke="#333"/>',
        f'<line x1="{PAD_L}" y1="{PAD_T}" x2="{PAD_L}" y2="{H - PAD_B}" stroke="#333"/>',
    ]
    for k in range(5):
        v = top * k / 4
        y = H - PAD_B - plot_h * k / 4
        out.append(
            f'<text x="{PAD_L - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11" '
            f'fill="#222">{esc(_fmt(v))}</text>'
        )
    n = max(1, len(labels))
    step = max(1, n // 8)
    for i, lab in enumerate(labels):
        if i % step == 0:
            x = PAD_L + plot_w * (i + 0.5) / n
            out.append(
                f'<text x="{x:.1f}" y="{H - PAD_B + 16}" text-anchor="middle" font-size="11" '
                f'fill="#222">{esc(lab)}</text>'
            )
    return "".join(out)


def bars(title: str, labels: Sequence[str], values: Sequence[float], unit: str = "") -> str:
    if not values:
        return _frame(
            title,
            "no data",
            f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle" fill="#222">no data</text>',
        )
    top = max(values) or 1.0
    plot_w, plot_h = W - PAD_L - 8, H - PAD_B - PAD_T
    n = len(values)
    bw = min(plot_w / n * 0.7, 48.0)
    rects = []
    for i, (lab, v) in enumerate(zip(labels, values, strict=True)):
        h = plot_h * v / top
        x = PAD_L + plot_w * (i + 0.5) / n - bw / 2
        rects.append(
            f'<rect x="{x:.1f}" y="{H - PAD_B - h:.1f}" width="{bw:.1f}" height="{h:.1f}" '
            f'fill="{COLOURS[0]}">'
            f"<title>{esc(lab)}: {esc(_fmt(v))}{esc(unit)}</title></rect>"
        )
    desc = "; ".join(f"{lab}: {_fmt(v)}{unit}" for lab, v in zip(labels, values, strict=True))
    return _frame(title, desc, _axes(top, labels) + "".join(rects))


def lines(
    title: str, labels: Sequence[str], series: dict[str, Sequence[float | None]], unit: str = ""
) -> str:
    vals = [v for s in series.values() for v in s if v is not None]
    if not vals:
        return _frame(
            title,
            "no data",
            f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle" fill="#222">no data</text>',
        )
    top = max(vals) or 1.0
    plot_w, plot_h = W - PAD_L - 8, H - PAD_B - PAD_T
    n = len(labels)
    out, legend = [], []
    for k, (name, s) in enumerate(series.items()):
        colour = COLOURS[k % len(COLOURS)]
        pts = [
            (PAD_L + plot_w * (i + 0.5) / n, H - PAD_B - plot_h * v / top)
            for i, v in enumerate(s)
            if v is not None
        ]
        if len(pts) > 1:
            out.append(
                f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="'
                + " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
                + '"/>'
            )
        out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>' for x, y in pts]
        legend.append(
            f'<rect x="{PAD_L + 10 + 110 * k}" y="2" width="10" height="10" fill="{colour}"/>'
            f'<text x="{PAD_L + 24 + 110 * k}" y="11" font-size="11" fill="#222">{esc(name)}</text>'
        )
    desc = "; ".join(
        f"{name}: "
        + ", ".join(
            f"{lab} {_fmt(v)}{unit}" for lab, v in zip(labels, s, strict=True) if v is not None
        )
        for name, s in series.items()
    )
    return _frame(title, desc, _axes(top, labels) + "".join(out) + "".join(legend))


def timeline(title: str, spans: Sequence[tuple[str, int, float, float, bool]]) -> str:
    """`spans`: (name, depth, start_ms, end_ms, error), in start order."""
    if not spans:
        return _frame(title, "no spans", "", 40, TW)
    total = max(e for _, _, _, e, _ in spans) or 1.0
    row, label_w = 22, 230
    height = row * len(spans) + 30
    plot_w = TW - label_w - 10
    out = []
    for i, (name, depth, s, e, err) in enumerate(spans):
        y = 10 + row * i
        x = label_w + plot_w * s / total
        w = max(1.5, plot_w * (e - s) / total)
        colour = COLOURS[1] if err else COLOURS[0] if depth <= 1 else COLOURS[2]
        out.append(
            f'<text x="{4 + 12 * depth}" y="{y + 13}" font-size="12" fill="#222">{esc(name)}</text>'
            f'<rect x="{x:.1f}" y="{y + 2}" width="{w:.1f}" height="14" fill="{colour}">'
            f"<title>{esc(name)}: {e - s:.2f} ms (from {s:.2f} ms)</title></rect>"
        )
    out.append(
        f'<text x="{TW - 10}" y="{height - 6}" text-anchor="end" font-size="11" '
        f'fill="#222">{total:.1f} ms</text>'
    )
    desc = "; ".join(f"{n}: {s:.1f}–{e:.1f} ms" for n, _, s, e, _ in spans)
    return _frame(title, desc, "".join(out), height, TW)
