"""Reading `bench.engine` results: the issue-3 targets, and the human-readable table."""

from __future__ import annotations

from typing import Any

# (name, threshold, how to read the value from a result): the figures the engine must reach.
TARGETS = (
    (
        "prefill >= 60% of the GEMM peak (engine's linear path, engine dtype)",
        0.6,
        lambda r: r["prefill"]["frac_peak"],
    ),
    (
        "steady decode with 32 sequences >= 600 tokens/s",
        600.0,
        lambda r: next(d["tokens_per_s"] for d in r["decode_steady"] if d["batch"] == 32),
    ),
    ("single-stream decode >= 40 tokens/s", 40.0, lambda r: r["decode_single"]["tokens_per_s"]),
    ("online throughput >= 3x transformers static batching", 3.0, lambda r: r["online"]["ratio"]),
)


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for name, threshold, get in TARGETS:
        try:
            value = get(result)
        except (KeyError, StopIteration):
            continue  # that figure was not measured in this run
        out.append({"target": name, "value": round(value, 3), "met": value >= threshold})
    return out


def _rows(title: str, header: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
    ]
    line = "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))
    body = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join([title, line, "-" * len(line), *body])


def table(r: dict[str, Any]) -> str:
    m, c, pk = r["machine"], r["config"], r["gemm_peak_gflops"]
    mm = pk["torch_mm"]
    parts = [
        f"engine benchmark: {c['model']} {c['dtype']} on {m['cpu']} ({m['threads']} threads, torch "
        f"{m['torch']}, load {m['load_avg_1m_at_start']} at start, {m.get('load_avg_1m_at_end')} "
        "at end)",
        f"GEMM peak ({pk['matmul_size']}^3, {pk['dtype']}, engine's {pk['engine_linear_path']}): "
        f"{pk['engine_linear']:.0f} GFLOP/s; torch.mm bf16 {mm['bfloat16']:.0f}, fp32 "
        f"{mm['float32']:.0f} GFLOP/s",
    ]
    p = r["prefill"]
    perf = [
        [
            "prefill",
            f"{p['prompt_tokens']} prompt",
            f"{p['tokens_per_s']:.0f} ({p['tokens_per_s_p10']:.0f}-{p['tokens_per_s_p90']:.0f})",
            f"{p['gflops']:.0f}",
            f"{p['frac_peak']:.0%}",
        ]
    ]
    for d in [r["decode_single"], *r["decode_steady"]]:
        ctx = f"ctx {d['context_tokens'][0]}-{d['context_tokens'][1]}"
        perf.append(
            [
                f"decode x{d['batch']}",
                ctx,
                f"{d['tokens_per_s']:.0f} "
                f"({d['tokens_per_s_p10']:.0f}-{d['tokens_per_s_p90']:.0f})",
                f"{d['gflops']:.0f}",
                f"{d['frac_peak']:.0%}",
            ]
        )
    header = ["figure", "shape", "tokens/s (p10-p90)", "GFLOP/s", "of peak"]
    parts.append(
        _rows(
            "\nthroughput: medians (prefill over prompts, decode over steps), p10-p90 in "
            "parentheses",
            header,
            perf,
        )
    )
    e2e = [
        [
            str(e["concurrency"]),
            f"{e['input_tokens']}/{e['output_tokens']}",
            f"{e['output_tokens_per_s']:.0f}",
            f"{e['ttft_s']['mean'] * 1e3:.0f}",
            f"{e['tpot_s']['mean'] * 1e3:.1f}",
        ]
        for e in r["end_to_end"]
    ]
    parts.append(
        _rows("\nend to end", ["concurrency", "in/out", "out tokens/s", "TTFT ms", "TPOT ms"], e2e)
    )
    o = r["online"]
    sys_rows = []
    for name in ("engine", "engine_static", "transformers"):
        if name in o:
            s = o[name]
            sys_rows.append(
                [
                    name,
                    f"{s['output_tokens_per_s']:.0f}",
                    f"{s['requests_per_s']:.2f}",
                    f"{s['seconds']:.1f}",
                    f"{s['ttft_s']['p50']:.2f}",
                    f"{s['e2e_latency_s']['p99']:.1f}",
                ]
            )
    title = (
        f"\nonline: {o['requests']} requests, Poisson {o['rate_per_s']}/s, batch {o['batch']}, "
        f"input mean {o['input_tokens']['mean']:.0f} (max {o['input_tokens']['max']:.0f}), "
        f"output mean {o['output_tokens']['mean']:.0f} (max {o['output_tokens']['max']:.0f})"
    )
    parts.append(
        _rows(
            title,
            ["system", "out tokens/s", "req/s", "span s", "TTFT p50 s", "latency p99 s"],
            sys_rows,
        )
    )
    parts.append(
        f"continuous batching (engine / engine_static): {o['ratio_continuous_batching']:.2f}x"
    )
    if "ratio" in o:
        parts.append(
            f"engine_static / transformers: {o['ratio_engine_static_over_transformers']:.2f}x"
        )
        parts.append(f"engine / transformers: {o['ratio']:.2f}x")
    if r.get("targets"):
        parts.append("\ntargets")
        parts += [
            f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['value']:g}"
            for t in r["targets"]
        ]
    return "\n".join(parts)
