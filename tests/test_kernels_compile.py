"""Ahead-of-time compile of every Triton kernel for sm_80 / sm_90 without a GPU (issue #32):
the specialisations come from the launchers, the hot decode configurations compile without
spills, and a broken kernel is caught."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from benchmarks import kernels_compile as aot
from quantmla.spec import QuantizerSpec

REPO = Path(__file__).resolve().parents[1]


def _uninterpreted_env():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    return env


def test_every_packed_format_in_conf_ships():
    """The compile covers each conf/precision format the packed cache can hold."""
    packed = []
    for path in sorted((REPO / "conf" / "precision").glob("*.yaml")):
        try:
            spec = QuantizerSpec.from_precision(path.stem)
        except Exception:  # mixed: per-layer formats, each one of these
            continue
        if spec.quantized and not spec.fp8 and max(spec.content_bits, spec.rope_bits) <= 8:
            packed.append(path.stem)
    assert sorted(packed) == sorted(aot.SHIPPED_FORMATS)


def test_specialisations_are_what_the_launchers_produce():
    """Recorded from the launchers: a format added to the shipped list adds its writer, gather
    and decode specialisations (per geometry and page size) and nothing else changes."""
    base = aot.specialisations(aot.record_launches())
    more = aot.specialisations(
        aot.record_launches(aot.SHIPPED_FORMATS + aot.WORD_FORMATS + ("c4r2",))
    )
    added = set(more) - set(base)
    assert set(base) <= set(more)
    per_kernel = {k: sum(1 for key in added if key[0] == k) for k in {key[0] for key in added}}
    cells = len(aot.GEOMETRIES) * len(aot.PAGES)
    assert per_kernel == {"_writer_kernel": cells, "_gather_pages_kernel": cells,
                          "_decode_split_kernel": cells}  # fmt: skip
    kernels = {key[0] for key in base}
    assert kernels == {"_writer_kernel", "_gather_pages_kernel", "_decode_split_kernel",
                       "_merge_kernel"}  # fmt: skip


def test_every_launch_goes_through_the_recording_seam():
    """No `kernel[grid](...)` outside launch.py: a launch that bypassed it would be missing from
    the compiled table."""
    direct = re.compile(r"\b_\w+_kernel\[")
    for path in (REPO / "kernels").rglob("*.py"):
        if path.name != "launch.py":
            assert not direct.search(path.read_text()), path


def test_hot_decode_compiles_for_sm80_and_sm90_without_spills(tmp_path):
    """The decode kernel as serving and the packed cache launch it (C4R4, C2R4; d_c 512; h_q 16
    and 128; pages of 16 and 64): compiled for both archs by Triton's own compiler — no error,
    no spill, shared memory within each arch's limit — and the printed count is the table's."""
    out = tmp_path / "hot.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels_compile", "--hot", "--out", str(out)],
        cwd=REPO, env=_uninterpreted_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert {e["arch"] for e in report["entries"]} == {80, 90}
    assert len(report["entries"]) == 2 * report["specialisations"]
    assert f"{report['specialisations']} distinct specialisations" in done.stdout
    formats = {f for e in report["entries"] for f in e["formats"]}
    assert formats == {"c4r4", "c2r4"}
    for e in report["entries"]:
        assert e["hot"] and e["spill_stores"] == 0 and e["spill_loads"] == 0, e
        assert 0 < e["shared_bytes"] <= e["shared_limit"] and e["registers"] <= 255
        assert e["blocks_per_sm"] >= 1 and e["cubin_bytes"] > 1000


def test_a_broken_kernel_is_caught():
    """A non-power-of-two tile is a compile error; a tl.dot over 256 × 256 fp32 tiles compiles
    but needs more shared memory than sm_90 allows per block: both refused."""
    script = (
        "import json, torch\n"
        "from benchmarks import kernels_compile as aot\n"
        "from quantmla_kernels.paged_cache.launch import Launch\n"
        "from tests.fixtures import broken_kernels as bk\n"
        "x = torch.zeros(256 * 256)\n"
        "out = []\n"
        "for l in (Launch(bk.odd_tile, (1,), (x, x), {'N': 96}),\n"
        "          Launch(bk.huge_dot, (1,), (x, x), {'N': 256, 'K': 256})):\n"
        "    r = aot.compile_one(l, 90)\n"
        "    out.append(aot.check(r, hot=False))\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=_uninterpreted_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    odd, huge = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(odd) == 1 and odd[0].startswith("compile error") and "power of 2" in odd[0]
    assert len(huge) == 1 and re.match(r"shared memory [\d,]+ B > 232,448 B", huge[0])


def test_occupancy_follows_the_register_file_and_shared_memory():
    arch = aot.ARCHS[90]
    assert aot.occupancy(arch, 222, 256, 77_824) == 1  # 222 regs → 224 per thread · 256 threads
    assert aot.occupancy(arch, 32, 128, 0) == 16  # threads: 2,048 / 128
    assert aot.occupancy(arch, 64, 128, 100_000) == 2  # shared: 233,472 // 100,000
    assert aot.check(
        {"shared_bytes": 1, "shared_limit": 2, "spill_stores": 4, "spill_loads": 0}, True
    )
    assert not aot.check(
        {"shared_bytes": 1, "shared_limit": 2, "spill_stores": 4, "spill_loads": 0}, False
    )
