"""bench.kernel_ab: two kernel builds side by side in one process, on the engine's linears.

Real builds, real engines (SmolLM2 from the local model store), no timing bound: what is checked
is that both builds ran every row count and that the "outputs identical" column tells a build
equal in arithmetic from one that is not.
"""

from __future__ import annotations

import json
import platform
import shutil
from pathlib import Path

import pytest

from bench import kernel_ab
from engine.kernels import kernels_lib

pytestmark = pytest.mark.skipif(kernels_lib() is None, reason="kernels unavailable (no C compiler)")

_KERNELS = Path(kernel_ab.__file__).resolve().parent.parent / "engine" / "kernels"


def _run(capsys, *argv: str) -> tuple[int, dict | None, str]:
    rc = kernel_ab.main(
        [*argv, "--schemes", "none,int8", "--rows", "1,16", "--reps", "2", "--json"]
    )
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if rc == 0 else None), err


def test_this_checkout_against_a_copy_of_its_own_sources_is_identical(capsys) -> None:
    rc, result, _ = _run(capsys, "--base-dir", str(_KERNELS))
    assert rc == 0
    assert set(result["schemes"]) == {"none", "int8"}
    for rows in result["schemes"].values():
        assert [r["rows"] for r in rows] == [1, 16]
        for r in rows:
            assert r["identical"] is True
            assert r["base_ms"] > 0 and r["this_ms"] > 0


@pytest.mark.skipif(
    kernels_lib() is None or kernels_lib().qgemm_bf16_isa() not in (1, 2),
    reason="no AVX-512 BF16 GEMM on this CPU (the changed line is that path's code)",
)
def test_a_build_whose_arithmetic_differs_is_reported(tmp_path: Path, capsys) -> None:
    """The baseline's bf16 linear adds 1 to every output: its rows must read as differing, and
    the int8 scheme's (scaled outputs: the change skips them) as identical."""
    src = tmp_path / "kernels"
    shutil.copytree(_KERNELS, src, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    path = src / "qgemm_bf16.h"
    text = path.read_text()
    anchor = "        if (bias) v0 = _mm512_add_ps(v0, b0), v1 = _mm512_add_ps(v1, b1);"
    assert anchor in text, "qb_store_rows32's bias line moved: update this test's anchor"
    path.write_text(
        text.replace(
            anchor, anchor + "\n        if (!scale) v0 = _mm512_add_ps(v0, _mm512_set1_ps(1.0f));"
        )
    )
    rc, result, _ = _run(capsys, "--base-dir", str(src))
    assert rc == 0
    assert all(r["identical"] is False for r in result["schemes"]["none"] if r["rows"] >= 16)
    assert all(r["identical"] is True for r in result["schemes"]["int8"])


def test_an_unknown_revision_is_a_clear_error(capsys) -> None:
    rc, result, err = _run(capsys, "--base", "no-such-revision-xyz")
    assert rc == 2 and result is None
    assert "no-such-revision-xyz" in err and "git archive" in err


def test_an_older_build_lacking_a_function_still_loads(tmp_path: Path) -> None:
    """A revision without one of today's exported functions (as an older one would be) loads,
    without that function, instead of being refused; the others are declared."""
    from engine.kernels import build_library

    src = tmp_path / "kernels"
    shutil.copytree(_KERNELS, src, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    path = src / "qgemv_int4.c"
    text = path.read_text()
    assert "int32_t qlinear_int4_path(void)" in text
    path.write_text(
        text.replace("int32_t qlinear_int4_path(void)", "int32_t qlinear_int4_path_renamed(void)")
    )
    lib = build_library(src, private_copy=True)
    assert not hasattr(lib, "qlinear_int4_path")
    assert lib.qgemm_bf16_isa() == kernels_lib().qgemm_bf16_isa()


def test_head_times_the_lm_head_on_fp32_rows(capsys) -> None:
    """--head: the logits of `rows` sequences (fp32 final-norm rows) through the bf16 lm_head and
    the int8 one (a QLinear inside the LogitsHead), both builds, outputs compared."""
    rc, result, _ = _run(capsys, "--base-dir", str(_KERNELS), "--head")
    assert rc == 0 and result["layers"] == "lm_head"
    for rows in result["schemes"].values():
        assert [r["rows"] for r in rows] == [1, 16]
        assert all(r["identical"] is True and r["base_ms"] > 0 for r in rows)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 levels")
def test_this_checkouts_portable_build_against_its_own(capsys) -> None:
    """--base-march builds the baseline for another x86 level (here the portable C), so a CPU's
    own paths are timed against it in one process; fp32 activations, as an AVX2 CPU runs them."""
    rc, result, _ = _run(capsys, "--base-march", "x86-64-v2", "--dtype", "float32")
    assert rc == 0
    assert (result["base_march"], result["march"]) == ("x86-64-v2", "native")
    assert all(r["base_ms"] > 0 and r["this_ms"] > 0 for r in result["schemes"]["int8"])
