"""Every Triton kernel of the project compiled ahead of time for sm_80 (A100) and sm_90
(H100/H200) — no GPU needed (issue #32). The cache's ops (`ops.write`, `ops.dequantize`,
`ops.decode`, as the serving backend and the packed cache call them; `launch_decode` as the latency
harness tunes it) run on small CPU tensors inside `launch.recording()`; each distinct recorded
launch is specialised by Triton's own binder for the target, compiled to a cubin, and its resources
read back: registers, spill stores/loads (local-memory instructions in the SASS), shared memory,
the occupancy they allow, cubin size. A checkout tool (run from the repository root), not an op.

    python -m benchmarks.kernels_compile [--hot] [--arch 80 90] [--jobs 2]
        [--out results/kernels_compile.json]

Exit status 1 on a compile error, shared memory above an arch's per-block limit, or spills in the
decode kernel's hot configurations (C4R4 / C2R4, d_c 512, h_q 16 and 128). Run it without
TRITON_INTERPRET=1 (the interpreter replaces the compiled kernels)."""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from quantmla.memory import layout as make_layout
from quantmla_kernels.paged_cache import ops
from quantmla_kernels.paged_cache.decode import launch_configs, launch_decode
from quantmla_kernels.paged_cache.launch import Launch, recording

# The packed formats that ship (every conf/precision format the packed cache holds; a test keeps
# the two lists equal) and formats that exercise the remaining packed words (1- and 6-bit codes).
SHIPPED_FORMATS = ("c4r4", "c2r4", "c3r4", "c8r8")
WORD_FORMATS = ("c1r6", "c6r3")
GEOMETRIES = ((512, 64), (256, 64))  # (d_c, d_r): the paper's six models; the tiny testbeds
HEADS = (16, 128)  # h_q per GPU: DeepSeek-V2-Lite; DeepSeek-V3/R1, Kimi-K2
PAGES = (16, 64)  # tokens per page: vLLM's block size; the project's pool
PROTECTION_DTYPES = (torch.bfloat16,)  # the served and pooled default (fp32 is a CPU check)
BENCH_FORMATS = ("c4r4", "c2r4")  # the latency harness's formats, its launch configs tuned
# the decode kernel as the serving backend and the packed cache launch it (their default launch
# configuration): must not spill. The latency harness's tuning candidates are reported only.
HOT = {"path": "decode", "kernel": "_decode_split_kernel", "formats": ("c4r4", "c2r4"), "d_c": 512}


@dataclass(frozen=True)
class Arch:
    cc: int
    name: str
    shared_per_block: int  # opt-in dynamic shared memory per block
    shared_per_sm: int
    regs_per_sm: int = 65536
    threads_per_sm: int = 2048
    blocks_per_sm: int = 32


ARCHS = {
    80: Arch(80, "sm_80 (A100)", 163 * 1024, 164 * 1024),
    90: Arch(90, "sm_90 (H100/H200)", 227 * 1024, 228 * 1024),
}


@dataclass
class Case:
    """One launch a GPU path makes: which path, the cache format and geometry it runs."""

    path: str
    precision: str = ""
    d_c: int = 0
    heads: int = 0
    page: int = 0
    kernel: str = ""  # filled from the recorded launch


def _layout(precision, d_c, d_r, page):
    return make_layout(precision, d_c=d_c, d_r=d_r, page_tokens=page)


def _decode_inputs(lay, batch, heads, context, prot_dtype):
    pages_per = -(-context // lay.page_tokens)
    storage = torch.zeros(batch * pages_per, lay.page_bytes(), dtype=torch.uint8)
    table = torch.arange(batch * pages_per, dtype=torch.int64).view(batch, pages_per)
    lens = torch.full((batch,), context, dtype=torch.int32)
    prot = torch.zeros(batch, lay.sink + lay.recent, lay.d_c + lay.d_r, dtype=prot_dtype)
    q = torch.zeros(batch, heads, lay.d_c)
    return dict(q_lat=q, q_rope=torch.zeros(batch, heads, lay.d_r), scaling=0.1, table=table,
                lens=lens, layout=lay, storage=storage, prot=prot)  # fmt: skip


def record_launches(formats=None) -> list[tuple[Case, Launch]]:
    """Every launch the GPU paths make, from the launchers themselves (recorded, not run)."""
    formats = formats or SHIPPED_FORMATS + WORD_FORMATS
    out: list[tuple[Case, Launch]] = []

    def take(case, launcher, *args, **kwargs):
        with recording() as launches:
            launcher(*args, **kwargs)
        out.extend((replace(case, kernel=launch.kernel.__name__), launch)
                   for launch in launches)  # fmt: skip

    for precision in formats:
        for d_c, d_r in GEOMETRIES:
            for page in PAGES:
                lay = _layout(precision, d_c, d_r, page)
                n = 2
                storage = torch.zeros(n, lay.page_bytes(), dtype=torch.uint8)
                pages = torch.zeros(n, dtype=torch.int64)
                rows = torch.zeros(n, d_c), torch.zeros(n, d_r)
                take(Case("writer", precision, d_c, 0, page), ops.write, storage, lay,
                     pages, torch.arange(n), *rows, "triton")  # fmt: skip
                workspace = torch.zeros(n * page, d_c + d_r, dtype=torch.bfloat16)
                take(Case("context gather", precision, d_c, 0, page), ops.dequantize, storage,
                     lay, pages, workspace, "triton")  # fmt: skip
                for heads in HEADS:  # the serving backend's and the packed cache's decode
                    for prot_dtype in PROTECTION_DTYPES:
                        for batch, context in ((1, 32768), (8, 4096)):  # merge widths
                            args = _decode_inputs(lay, batch, heads, context, prot_dtype)
                            take(Case("decode", precision, d_c, heads, page),
                                 ops.decode, **args, kernel="triton")  # fmt: skip
    for precision in BENCH_FORMATS:  # the latency harness (Fig. 5b): tuned launch configs
        if precision not in formats:
            continue
        for heads in HEADS:
            lay = _layout(precision, 512, 64, 64)
            args = _decode_inputs(lay, 4, heads, 8192, torch.bfloat16)
            bf16 = torch.zeros(args["storage"].shape[0], 64, 576, dtype=torch.bfloat16)
            for config in launch_configs(heads):
                take(Case("latency harness", precision, 512, heads, 64),
                     launch_decode, **args, **config)  # fmt: skip
                take(Case("latency harness (BF16 pages)", "bf16", 512, heads, 64),
                     launch_decode, **{**args, "prot": None}, bf16_pages=bf16, **config)  # fmt: skip
    return out


def _kind(value) -> str:
    """A runtime argument as Triton's binder specialises it: a pointer's dtype (and 16-byte
    alignment), an integer equal to 1 or divisible by 16, else its type."""
    if isinstance(value, torch.Tensor):
        aligned = "" if value.data_ptr() % 16 else " (unaligned)"
        return f"*{str(value.dtype).removeprefix('torch.')}{aligned}"
    if isinstance(value, bool) or not isinstance(value, int):
        return type(value).__name__
    return "int=1" if value == 1 else ("int%16" if value % 16 == 0 else "int")


def _constexprs(kernel) -> set[str]:
    return {name for name, p in inspect.signature(kernel.fn).parameters.items()
            if "constexpr" in str(p.annotation)}  # fmt: skip


def specialisation_key(launch: Launch) -> tuple:
    """What makes two launches one compiled kernel: the function, each runtime argument's kind,
    the constexprs' values and the launch options (num_warps, num_stages)."""
    fixed = _constexprs(launch.kernel)
    kw = tuple(sorted((k, str(v)) for k, v in launch.kwargs.items() if k in fixed
                      or k in ("num_warps", "num_stages")))  # fmt: skip
    runtime = tuple(sorted((k, _kind(v)) for k, v in launch.kwargs.items() if k not in dict(kw)))
    return (launch.kernel.__name__, tuple(_kind(a) for a in launch.args) + runtime, kw)


def specialisations(recorded) -> dict[tuple, list[tuple[Case, Launch]]]:
    """Distinct specialisations → the cases that launch them."""
    out: dict[tuple, list] = {}
    for case, launch in recorded:
        out.setdefault(specialisation_key(launch), []).append((case, launch))
    return out


# ------------------------------------------------------------------------------------- compile


def _nvidia_tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def cubin_resources(cubin: bytes) -> dict:
    """Registers and stack frame (`cuobjdump --dump-resource-usage`) and the spill instructions
    in the SASS (local-memory stores STL / loads LDL, `cuobjdump -sass`) of one cubin — read from
    the binary, so a kernel from Triton's cache reports the same as a fresh compile."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_nvidia_tool("cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
        sass = subprocess.run([_nvidia_tool("cuobjdump"), "-sass", f.name],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip

    def grab(key):
        m = re.search(rf"\b{key}:(\d+)", usage)
        return int(m[1]) if m else 0

    return {
        "registers": grab("REG"),
        "stack_bytes": grab("STACK"),
        "spill_stores": len(re.findall(r"\bSTL(?:\.\w+)*\s", sass)),
        "spill_loads": len(re.findall(r"\bLDL(?:\.\w+)*\s", sass)),
    }


def occupancy(arch: Arch, registers: int, threads: int, shared: int) -> int:
    """Resident blocks per SM the registers (per warp, in 256-register units), threads and
    shared memory allow."""
    warps = -(-threads // 32)
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    limits = [
        arch.blocks_per_sm,
        arch.threads_per_sm // threads,
        arch.regs_per_sm // (regs_per_warp * warps),
    ]
    if shared:
        limits.append(arch.shared_per_sm // shared)
    return max(0, min(limits))


def compile_one(launch: Launch, cc: int) -> dict:
    """Compile one recorded launch for compute capability `cc`: its resources, or its error."""
    import triton
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import create_function_from_signature

    arch, kernel = ARCHS[cc], launch.kernel
    target = GPUTarget("cuda", cc, 32)
    backend = backends["nvidia"].compiler(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, launch.kwargs, bound, spec, options
    )
    started = time.perf_counter()
    try:
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs, attrs), target=target,
            options=options.__dict__,
        )  # fmt: skip
    except Exception as err:  # a compile error is a result: reported, and the run fails
        text = " | ".join(line.strip() for line in str(err).splitlines() if line.strip())
        return {"arch": cc, "error": f"{type(err).__name__}: {text[:400]}"}
    seconds = time.perf_counter() - started
    meta = compiled.metadata
    threads = meta.num_warps * 32
    usage = cubin_resources(compiled.asm["cubin"])
    shared = int(meta.shared)
    return {
        "arch": cc,
        "num_warps": meta.num_warps,
        "num_stages": meta.num_stages,
        **usage,
        "shared_bytes": shared,
        "shared_limit": arch.shared_per_block,
        "blocks_per_sm": occupancy(arch, usage["registers"], threads, shared),
        "cubin_bytes": len(compiled.asm["cubin"]),
        "compile_s": round(seconds, 2),
    }


def _compile_task(task):
    """Worker: rebuild the launch from its recorded form (kernel by module and name)."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated
    module, name, args, kwargs, cc = task
    kernel = getattr(importlib.import_module(module), name)
    return compile_one(Launch(kernel, (), args, kwargs), cc)


def _portable(launch: Launch):
    kernel = launch.kernel
    return (kernel.fn.__module__, kernel.__name__, launch.args, launch.kwargs)


def check(entry: dict, hot: bool) -> list[str]:
    """The reasons an entry fails: an error, shared memory over the limit, hot-path spills."""
    problems = []
    if "error" in entry:
        return [f"compile error: {entry['error']}"]
    if entry["shared_bytes"] > entry["shared_limit"]:
        problems.append(f"shared memory {entry['shared_bytes']:,} B > {entry['shared_limit']:,} B")
    if hot and (entry["spill_stores"] or entry["spill_loads"] or entry.get("stack_bytes")):
        problems.append(
            f"spills in a hot decode configuration ({entry['spill_stores']} local stores, "
            f"{entry['spill_loads']} local loads in the SASS)"
        )
    return problems


def is_hot(case: Case) -> bool:
    return (case.path == HOT["path"] and case.kernel == HOT["kernel"]
            and case.precision in HOT["formats"] and case.d_c == HOT["d_c"])  # fmt: skip


def _describe(key, cases) -> dict:
    kernel, kinds, kwargs = key
    kw = dict(kwargs)
    paths = sorted({c.path for c in cases})
    formats = sorted({c.precision for c in cases if c.precision})
    return {
        "kernel": kernel,
        "paths": paths,
        "formats": formats,
        "d_c": sorted({c.d_c for c in cases}),
        "heads": sorted({c.heads for c in cases if c.heads}),
        "page": sorted({c.page for c in cases if c.page}),
        "constexprs": {k: v for k, v in kw.items() if k not in ("num_warps", "num_stages")},
        "num_warps": int(kw.get("num_warps", 4)),
        "argument_kinds": list(kinds),
        "hot": any(is_hot(c) for c in cases),
    }


def run(archs=(80, 90), jobs: int = 2, hot_only: bool = False, formats=None) -> dict:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("error: compile the kernels without TRITON_INTERPRET=1 (the interpreter "
                         "replaces the compiled kernels)")  # fmt: skip
    recorded = record_launches(formats)
    table = specialisations(recorded)
    if hot_only:
        table = {k: v for k, v in table.items() if any(is_hot(c) for c, _ in v)}
    keys = list(table)
    print(f"[kernels] {len(table)} distinct specialisations from {len(recorded)} recorded "
          f"launches; compiling each for {', '.join(ARCHS[a].name for a in archs)}", flush=True)  # fmt: skip
    tasks = [(*_portable(table[k][0][1]), cc) for k in keys for cc in archs]
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = []
        for i, result in enumerate(pool.map(_compile_task, tasks), 1):
            results.append(result)
            if i % 10 == 0 or i == len(tasks):
                print(f"[kernels] compiled {i}/{len(tasks)}", flush=True)
    entries, failures = [], []
    for i, key in enumerate(keys):
        described = _describe(key, [c for c, _ in table[key]])
        for j, cc in enumerate(archs):
            result = results[i * len(archs) + j]
            problems = check(result, described["hot"])
            entries.append({**described, **result, "problems": problems})
            failures += [f"{described['kernel']} sm_{cc} {described['constexprs']}: {p}"
                         for p in problems]  # fmt: skip
    import triton

    return {
        "triton": triton.__version__,
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {platform.system()}, no GPU needed",
        "archs": {str(a): ARCHS[a].name for a in archs},
        "specialisations": len(table),
        "recorded_launches": len(recorded),
        "entries": entries,
        "failures": failures,
    }


def device_check(report: dict) -> list[dict]:
    """On a CUDA device: each hot decode specialisation launched for real (Triton's JIT, the
    device's own arch), its registers, spills and shared memory beside the prediction for that
    arch — the report's entry, compiled here only for an arch the report lacks."""
    major, minor = torch.cuda.get_device_capability()
    cc = 10 * major + minor
    if cc not in ARCHS:
        ARCHS[cc] = Arch(cc, f"sm_{cc}", ARCHS[90].shared_per_block, ARCHS[90].shared_per_sm)
    rows = []
    for cases in specialisations(record_launches(HOT["formats"])).values():
        if not any(is_hot(c) for c, _ in cases):
            continue
        launch = cases[0][1]
        described = _describe(specialisation_key(launch), [c for c, _ in cases])
        same = ("kernel", "constexprs", "num_warps", "argument_kinds")
        predicted = next(
            (e for e in report["entries"]
             if e["arch"] == cc and all(e[k] == described[k] for k in same)),
            None,
        ) or compile_one(launch, cc)  # fmt: skip

        def cuda(v):
            return v.cuda() if isinstance(v, torch.Tensor) else v

        compiled = launch.kernel[launch.grid](
            *map(cuda, launch.args), **{k: cuda(v) for k, v in launch.kwargs.items()}
        )
        torch.cuda.synchronize()
        rows.append({
            **{k: described[k] for k in ("kernel", "formats", "d_c", "page", "num_warps")},
            "arch": cc,
            "predicted": {k: predicted.get(k) for k in ("registers", "spill_stores", "shared_bytes")},
            "measured": {"registers": compiled.n_regs, "spills": compiled.n_spills,
                         "shared_bytes": int(compiled.metadata.shared)},
        })  # fmt: skip
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], choices=sorted(ARCHS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--hot", action="store_true", help="only the hot decode configurations")
    parser.add_argument("--formats", nargs="+", default=None, help="default: every shipped one")
    parser.add_argument("--out", default=None, help="write the table as JSON here")
    parser.add_argument(
        "--device-check", action="store_true",
        help="on a CUDA device: also launch the hot decode configurations for real and record "
        "what the JIT compiled beside the prediction (make gpu-check)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    report = run(tuple(args.arch), args.jobs, args.hot, args.formats)
    if args.device_check:
        report["device"] = torch.cuda.get_device_name(0)
        report["device_check"] = device_check(report)
        for row in report["device_check"]:
            print(f"  device {row['formats']} page {row['page']}: predicted {row['predicted']}, "
                  f"ran {row['measured']}")  # fmt: skip
    print(f"[kernels] {report['specialisations']} specialisations x {len(args.arch)} archs")
    for e in report["entries"]:
        if "error" in e:
            continue
        print(f"  {e['kernel']:<22} sm_{e['arch']} regs {e['registers']:>3} spill "
              f"{e['spill_stores']:>5}/{e['spill_loads']:<5} shared {e['shared_bytes']:>7,} "
              f"blocks/SM {e['blocks_per_sm']:>2}  {e['formats']} d_c {e['d_c']} "
              f"{ {k: v for k, v in e['constexprs'].items() if k in ('BLOCK_H', 'PAGE', 'TILE', 'BLOCK_S')} } "
              f"warps {e['num_warps']}")  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"[kernels] wrote {args.out}")
    for failure in report["failures"]:
        print(f"FAIL {failure}", file=sys.stderr)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
