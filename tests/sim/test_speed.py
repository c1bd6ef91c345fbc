"""The machine-speed probe (sim/speed.py): it times its two shapes on a real engine and leaves it
empty; a profile moves to the speed read now — prompt terms by the prefill ratio, the rest by
the decode ratio — and stays as it is without a probe of its own or with another chunk."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from sim import profile as pf
from sim import speed
from tests.sim.helpers import toy_profile


def test_probe_times_both_shapes_on_a_real_engine(tiny_llama: Path) -> None:
    core = EngineCore(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32", threads=1, kv_memory="8MiB",
                                   max_model_len=512, max_num_batched_tokens=128, enable_prefix_caching=False))  # fmt: skip
    p = speed.probe(core, reps=2)
    assert p.prefill_cpu_s > 0 and p.decode_cpu_s > 0 and p.chunk == 128
    assert not core.has_work() and not core.scheduler.requests


def test_a_profile_moves_to_the_speed_read_now() -> None:
    then = pf.SpeedProbe(prefill_cpu_s=1.0, decode_cpu_s=0.1, chunk=512)
    prof = msgspec.structs.replace(toy_profile(), probe=then)
    step = msgspec.structs.replace(prof.step, cached_attention_s=3e-9)
    prof = msgspec.structs.replace(prof, step=step)
    now = pf.SpeedProbe(prefill_cpu_s=2.0, decode_cpu_s=0.15, chunk=512)
    m = prof.at_speed(now).step
    assert (m.prefill_s, m.attention_s, m.cached_attention_s) == pytest.approx((2 * step.prefill_s, 2 * step.attention_s, 6e-9))
    assert (m.intercept_s, m.decode_s, m.context_s) == pytest.approx(
        (1.5 * step.intercept_s, 1.5 * step.decode_s, 1.5 * step.context_s))
    assert prof.at_speed(now).probe == now
    assert toy_profile().at_speed(now) == toy_profile()  # no probe of its own: nothing to compare
    other = pf.SpeedProbe(prefill_cpu_s=2.0, decode_cpu_s=0.15, chunk=256)
    assert prof.at_speed(other) is prof  # another chunk is another shape
