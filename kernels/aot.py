"""Ahead-of-time compilation of every kernel configuration the Triton backend can select.

Needs only Triton (no torch, no GPU): ``python kernels/aot.py [--arch 80 90] [--subset]``
compiles each configuration for real GPU targets, reports shared memory, registers and
spills (``cuobjdump --dump-resource-usage`` from the Triton wheel) and whether the PTX uses
``mma`` for the tensor-core precisions, and exits non-zero if anything fails to compile or
spills. ``configurations()`` is the dispatch space of ``fgd_fast.backends.triton``; a test
checks that every launch made by the backend is one of them.
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def _kernels():
    """The kernel module, loaded by path so that this script needs no torch."""
    try:
        from fgd_fast.kernels import fgd_step
        return fgd_step
    except ImportError:
        spec = importlib.util.spec_from_file_location("fgd_step", os.path.join(os.path.dirname(__file__), "fgd_step.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


PRECISIONS = {"float32": ("ieee", "tf32x3", "tf32"), "float64": ("ieee",)}
_PTR = {"float32": "*fp32", "float64": "*fp64"}


def configurations():
    """Every (kernel, constexprs, options) the dispatcher can launch."""
    K = _kernels()
    out = []
    for dtype, acc in K.ACC_OF.items():
        for precision, rows in itertools.product(PRECISIONS[acc], (True, False)):
            common = dict(DTYPE=dtype, ACC=acc, ROWS=rows, PRECISION=precision)
            for block in (K.BLOCK_A, K.BLOCK_B, K.BLOCK_C, K.BLOCK_E):
                out.append(("gram_kernel", dict(common, BLOCK=block), K.kernel_config(K.GRAM_CONFIG, dtype, precision)))
            for mode, has_phi in ((K.MODE_PHI, True), (K.MODE_THETA, True), (K.MODE_THETA, False)):
                out.append(("update_kernel", dict(common, MODE=mode, HAS_PHI=has_phi), K.kernel_config(K.UPDATE_CONFIG, dtype, precision)))
    return out


def _signature(kernel, acc):
    ptr = _PTR[acc]
    types = dict(
        meta_ptr="*i64", work_ptr="*i32", out_ptr=ptr, split_stride="i64",
        hyper_ptr=ptr, n_items="i32", m_ptr=ptr, scratch_ptr=ptr, P_MAX="i32",
    )
    return {name: types.get(name, "constexpr") for name in kernel.arg_names}


def compile_one(name, consts, config, arch):
    """Compile one configuration; return a JSON-able report."""
    K = _kernels()
    kernel = getattr(K, name)
    blocks = {k: v for k, v in config.items() if not k.startswith("num_")}
    consts = dict(consts, **blocks)
    consts = {k: (getattr(tl, v) if k in ("DTYPE", "ACC") else v) for k, v in consts.items()}
    src = ASTSource(fn=kernel, signature=_signature(kernel, config_acc(consts)), constexprs=consts)
    options = {k: v for k, v in config.items() if k.startswith("num_")}
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    usage = _resource_usage(compiled.asm["cubin"])
    return dict(
        kernel=name, arch=arch, config={k: str(v) for k, v in consts.items()},
        shared=compiled.metadata.shared, mma="mma" in compiled.asm["ptx"], **usage,
    )


def config_acc(consts):
    return "float64" if consts["ACC"] == tl.float64 else "float32"


def _resource_usage(cubin: bytes) -> dict:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = [ln for ln in text.splitlines() if "REG:" in ln][-1]
    fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
    return dict(registers=int(fields["REG"]), stack=int(fields["STACK"]))


def _job(args):
    try:
        return compile_one(*args)
    except Exception as exc:  # reported, and fails the run
        name, consts, _, arch = args
        return dict(kernel=name, arch=arch, config={k: str(v) for k, v in consts.items()}, error=repr(exc))


def main(argv=None) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("kernels/aot.py: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)", file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    ap.add_argument("--subset", action="store_true", help="only float32 and float64 parameters (API-drift check)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", help="write the per-configuration report here")
    args = ap.parse_args(argv)
    configs = [c for c in configurations() if not args.subset or c[1]["DTYPE"] in ("float32", "float64")]
    jobs = [(name, consts, config, arch) for arch in args.arch for name, consts, config in configs]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(_job, jobs))
    bad = [r for r in results if "error" in r or r.get("stack", 0) != 0]
    for r in results:
        status = r.get("error") or f"regs {r['registers']:3d} stack {r['stack']} shared {r['shared']} mma {r['mma']}"
        print(f"sm_{r['arch']} {r['kernel']:13s} {json.dumps(r['config'], sort_keys=True)}: {status}")
    print(f"triton {triton.__version__}: {len(results)} compiled, {len(bad)} failed or spilled")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
