"""`duet bench serve`: load-test an OpenAI-compatible server and report latency, throughput,
goodput and failures (see `duet bench serve --help`; also `python -m bench.serve`).

Composition root of the bench: parses the command line, loads the tokenizer and dataset,
opens the process's one aiohttp ClientSession, runs the load (once, or once per sweep value)
with scrapes and progress around it, then prints the table or JSON and writes plots.
Exit status: 0 when at least one request completed, 1 when none did, 2 for a usage error.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from bench import plots, report
from bench.loadgen import run_load, warm_up
from bench.multiturn import run_multiturn
from bench.progress import RunProgress
from bench.prompts import PromptBuilder
from bench.scrape import Scraper
from bench.serve_args import build_parser, to_config
from bench.serve_config import ServeConfig
from bench.sweep import sweep_result
from bench.trace import load_trace, replay
from bench.workloads import BenchRequest, load_sharegpt, sharegpt, synthetic
from runtime.models import DEFAULT_MODEL, ModelNotFoundError, resolve_model
from text.tokenizer import Tokenizer

Workload = Callable[[int], Iterator[BenchRequest]]


def load_tokenizer(ref: str) -> Tokenizer:
    """A directory holding tokenizer.json (a tokenizer alone is enough for the bench), else a
    model reference resolved like everywhere in duet."""
    path = Path(ref).expanduser()
    if (path / "tokenizer.json").is_file():
        return Tokenizer(path)
    return Tokenizer(resolve_model(ref).directory)


def make_builder(cfg: ServeConfig) -> PromptBuilder:
    """The prompt builder, with the tokenizer the prompts need (loaded once)."""
    tok = None
    if cfg.tokenizer or cfg.prompt_format == "text" or cfg.chat:
        tok = load_tokenizer(cfg.tokenizer or DEFAULT_MODEL)
    return PromptBuilder(cfg.prompt_format, tok, cfg.vocab_size)


def make_workload(cfg: ServeConfig) -> Workload:
    """Loads what the workload needs once (tokenizer, file); returns seed → requests."""
    builder = make_builder(cfg)
    out_len = cfg.output_len if cfg.output_len_set else None
    if cfg.dataset == "sharegpt":
        entries = load_sharegpt(Path(cfg.dataset_path or ""), builder, out_len)
        return lambda seed: sharegpt(entries, out_len, seed)
    if cfg.dataset == "trace":
        trace = load_trace(Path(cfg.dataset_path or ""))
        fixed_out = int(cfg.output_len.a) if out_len and out_len.kind == "fixed" else None
        return lambda seed: replay(
            trace, builder, cfg.trace_block_size, cfg.trace_time_scale, seed, fixed_out
        )
    return lambda seed: synthetic(
        builder, cfg.input_len, cfg.output_len, seed, cfg.prefix_groups, cfg.prefix_len
    )


async def discover_model(session: aiohttp.ClientSession, cfg: ServeConfig) -> str | None:
    """The first model of the server's /v1/models, or None if it has no such list."""
    try:
        key = cfg.api_key or (cfg.teams[0].key if cfg.teams else None)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        timeout = aiohttp.ClientTimeout(total=10)
        async with session.get(
            cfg.base_url.rstrip("/") + "/v1/models",
            headers=headers,
            timeout=timeout,
            allow_redirects=False,
        ) as r:
            if r.status != 200:
                return None
            data = (await r.json()).get("data") or []
            return str(data[0]["id"]) if data else None
    except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError, AttributeError):
        return None


async def run_once(
    session: aiohttp.ClientSession,
    cfg: ServeConfig,
    workload: Workload,
    quiet: bool,
    stop: asyncio.Event,
    warmup: bool = True,
) -> dict[str, Any]:
    if cfg.workload == "multi-turn":
        return await _run_multiturn(session, cfg, quiet, stop)
    requests = workload(cfg.seed)
    if (
        cfg.num_requests is not None
    ):  # built before the clock starts: no tokenizer work between sends
        requests = iter(list(itertools.islice(requests, cfg.num_requests)))
    sent, failed = await warm_up(session, cfg, workload(cfg.seed + 100)) if warmup else (0, 0)
    scraper = Scraper(session, cfg.scrape_urls, cfg.scrape_interval)
    with RunProgress(cfg.label or "bench", cfg.num_requests, cfg.duration_s, quiet) as progress:
        async with scraper.around():
            outcome = await run_load(session, cfg, requests, progress.done, stop)
    outcome.warmup_sent, outcome.warmup_failed = sent, failed
    return report.build_result(cfg, outcome, scraper.result() if cfg.scrape_urls else None)


async def _run_multiturn(
    session: aiohttp.ClientSession, cfg: ServeConfig, quiet: bool, stop: asyncio.Event
) -> dict[str, Any]:
    """A multi-turn run (bench/multiturn.py): no warm-up (first turns are cold by design)."""
    builder = make_builder(cfg)
    mt = cfg.multi_turn
    scraper = Scraper(session, cfg.scrape_urls, cfg.scrape_interval)
    total = cfg.num_requests or mt.conversations * mt.turns
    with RunProgress(cfg.label or "bench", total, cfg.duration_s, quiet) as progress:
        async with scraper.around():
            outcome, figures = await run_multiturn(session, cfg, builder, progress.done, stop)
    result = report.build_result(cfg, outcome, scraper.result() if cfg.scrape_urls else None)
    result["multi_turn"] = figures
    return result


def _sweep_configs(cfg: ServeConfig) -> list[ServeConfig]:
    assert cfg.sweep is not None
    out = []
    for v in cfg.sweep.values:
        label = f"{cfg.label + ' ' if cfg.label else ''}{cfg.sweep.param}={v:g}"
        if cfg.sweep.param == "request-rate":
            out.append(msgspec.structs.replace(cfg, request_rate=v, label=label))
        else:
            out.append(msgspec.structs.replace(cfg, max_concurrency=int(v), label=label))
    return out


async def run_all(
    cfg: ServeConfig, workload: Workload, quiet: bool
) -> tuple[ServeConfig, dict[str, Any]]:
    # limit=0: the connection pool must never cap concurrency below what the run asks for
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, read_bufsize=1 << 20, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        if cfg.model is None:
            model = await discover_model(session, cfg)
            if model is not None:
                cfg = msgspec.structs.replace(cfg, model=model)
            elif not quiet:
                print(
                    "note: no --model and no /v1/models on the server: requests carry no model",
                    file=sys.stderr,
                )
        stop = _stop_on_ctrl_c(quiet)
        if cfg.sweep is None:
            return cfg, await run_once(session, cfg, workload, quiet, stop)
        runs = []
        for i, c in enumerate(_sweep_configs(cfg)):
            if stop.is_set():
                break
            runs.append(await run_once(session, c, workload, quiet, stop, warmup=i == 0))
        done = msgspec.structs.replace(cfg.sweep, values=cfg.sweep.values[: len(runs)])
        return cfg, sweep_result(done, runs, cfg.slo_ttft_ms, cfg.public())


def _stop_on_ctrl_c(quiet: bool) -> asyncio.Event:
    """The first Ctrl-C sets the event (sending stops, in-flight requests finish, the result is
    reported); the handler then steps aside, so a second Ctrl-C aborts as usual."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def first() -> None:
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)
        if not quiet:
            print(
                "\nstopping: no new requests; waiting for those in flight (Ctrl-C again to abort)",
                file=sys.stderr,
                flush=True,
            )

    with contextlib.suppress(NotImplementedError, RuntimeError):  # no signals off the main thread
        loop.add_signal_handler(signal.SIGINT, first)
    return stop


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = to_config(args)
        workload = make_workload(cfg)
    except (ValueError, ModelNotFoundError, FileNotFoundError) as e:
        print(f"duet bench serve: error: {e}", file=sys.stderr)
        return 2
    cfg, result = asyncio.run(run_all(cfg, workload, args.quiet))
    text = json.dumps(result)
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(text, flush=True)
    else:
        console = report.console()
        if cfg.sweep is None:
            report.print_run(result, console)
        else:
            for run in result["runs"]:
                report.print_run(run, console)
            report.print_sweep(result, console)
    if args.plot:
        written = (
            plots.plot_run(result, Path(args.plot))
            if cfg.sweep is None
            else plots.plot_sweep(result, Path(args.plot))
        )
        if not args.quiet:
            print("plots: " + ", ".join(str(p) for p in written), file=sys.stderr)
    runs = result["runs"] if cfg.sweep is not None else [result]
    if not any(r["completed"] for r in runs):
        print("duet bench serve: no request completed (see failures)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
