"""Ahead-of-time compilation of every kernel configuration the Triton backend can select.

Needs only Triton (no torch, no GPU): ``python kernels/aot.py [--arch 80 90] [--subset]``
compiles each configuration for real GPU targets, reports shared memory, registers and
spills (``cuobjdump --dump-resource-usage`` from the Triton wheel) and the instructions of its
products in the SASS (``cuobjdump -sass``): tensor-core ``HGMMA`` (sm_90) / ``HMMA`` (sm_80)
or ``FFMA``/``DFMA``. It exits non-zero if anything fails to compile, spills, or a tensor-core
configuration has no tensor-core instruction. ``configurations()`` is the dispatch space of
``fgd_fast.backends.triton``; a test checks that every launch made by the backend is one of them.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def _kernels(name: str = "fgd_step"):
    """A kernel module (``fgd_step``, ``tc_step``, ``guard``); without fgd_fast (no torch) the kernel
    folder is loaded by path as a package, so that this script needs only Triton."""
    try:
        return importlib.import_module(f"fgd_fast.kernels.{name}")
    except ImportError:
        package = "_fgd_fast_kernels"
        if package not in sys.modules:
            here = os.path.dirname(os.path.abspath(__file__))
            spec = importlib.util.spec_from_file_location(
                package, os.path.join(here, "__init__.py"), submodule_search_locations=[here]
            )
            module = importlib.util.module_from_spec(spec)
            sys.modules[package] = module
            spec.loader.exec_module(module)
        return importlib.import_module(f"{package}.{name}")


PRECISIONS = {"float32": ("ieee", "tf32x3", "tf32"), "float64": ("ieee",)}
_PTR = {"float32": "*fp32", "float64": "*fp64"}


def configurations():
    """Every (kernel, constexprs, options) the dispatcher can launch: the CUDA-core kernels for
    every (dtype, precision) not on tensor cores, the tensor-core kernels for float32 at the
    tensor-core precisions (``ALIGNED`` either way)."""
    K, T, M = _kernels("fgd_step"), _kernels("tc_step"), _kernels("meta")
    out = []
    for dtype, acc in K.ACC_OF.items():
        for precision, rows in itertools.product(PRECISIONS[acc], (True, False)):
            if dtype == "float32" and precision in T.PRECISIONS:
                continue  # the tensor-core kernels below
            common = dict(DTYPE=dtype, ACC=acc, ROWS=rows, PRECISION=precision)
            for block in (M.SLOT_A, M.SLOT_E, M.SLOT_B, M.SLOT_C, M.SLOT_G, M.SLOT_H):
                out.append(("gram_kernel", dict(common, BLOCK=block), K.kernel_config(K.GRAM_CONFIG, dtype, precision)))
            for mode, has_phi in ((M.MODE_PHI, True), (M.MODE_THETA, True), (M.MODE_THETA, False)):
                config = K.kernel_config(K.UPDATE_CONFIG, dtype, precision)
                out.append(("update_kernel", dict(common, MODE=mode, HAS_PHI=has_phi), config))
    for precision, rows, aligned in itertools.product(T.PRECISIONS, (True, False), (True, False)):
        common = dict(ROWS=rows, ALIGNED=aligned)
        out.append(("tc_split_kernel", dict(common, LO=precision == "tf32x3"), T.SPLIT_CONFIG))
        out.append(("tc_gram_kernel", dict(common, PRECISION="tf32"), T.GRAM_CONFIG[precision, aligned]))
        for has_phi in (True, False):
            config = T.UPDATE_CONFIG[precision, aligned]
            out.append(("tc_update_kernel", dict(common, HAS_PHI=has_phi, PRECISION="tf32"), config))
    G = _kernels("guard")  # the step guard's blend (every backend dtype's blocks: float32 or float64)
    for acc in ("float32", "float64"):
        for mode in (M.GB_W_GIVEN, M.GB_W_G, M.GB_W_CHG):
            out.append(("guard_sums_kernel", dict(ACC=acc, W_MODE=mode), dict(BT=G.TILE)))
        # FULL (with FEEDBACK for the CUDA-core classes that read Φ): the fused middle's (float32)
        for full, feedback in ((False, False), (True, False), (True, True)) if acc == "float32" else ((False, False),):
            out.append(("guard_blend_kernel", dict(ACC=acc, FULL=full, FEEDBACK=feedback), dict(BT=G.TILE)))
    for guard in (True, False):  # HYPER: the fused middle's (float32 hyper-parameters); else float64 tables
        out.append(("guard_choose_kernel", dict(ACC="float32", HYPER=True, GUARD=guard), {}))
        out.append(("guard_choose_kernel", dict(ACC="float64", HYPER=False, GUARD=guard), {}))
    P = _kernels("products")  # the middle's products over every layer of a layout
    for tx, has_z, big, precision in itertools.product((True, False), (True, False), (True, False), ("ieee", "tf32")):
        consts = dict(ACC="float32", TX=tx, HAS_Z=has_z, PRECISION=precision)  # (float64: torch's products)
        out.append(("mid_mm_kernel", consts, P.CONFIG[big]))
    for big, precision in itertools.product((True, False), ("ieee", "tf32")):  # the fused middle's products
        out.append(("mid_jobs_kernel", dict(PRECISION=precision), P.CONFIG[big]))
    MP = _kernels("middle")  # the fused middle's prologue
    for has_phi in (True, False):
        out.append(("mid_prep_kernel", dict(HAS_PHI=has_phi), MP.CONFIG))
    B = _kernels("blocks")  # the Gram blocks gathered into the middle's layout
    for has_phi, predict in itertools.product((True, False), (True, False)):
        common = dict(HAS_PHI=has_phi, PREDICT=predict)
        for acc in ("float32", "float64"):  # the CUDA-core classes: full blocks
            consts = dict(common, ACC=acc, MIRROR=False, LO=False, UPPER=1)
            out.append(("gram_gather_kernel", consts, B.CONFIG[acc]))
        for lo, aligned in itertools.product((True, False), (True, False)):  # tensor cores: upper tiles
            upper = T.GRAM_CONFIG["tf32", aligned]["BM"]
            consts = dict(common, ACC="float32", MIRROR=True, LO=lo, UPPER=upper)
            out.append(("gram_gather_kernel", consts, B.CONFIG["float32"]))
    return sorted({json.dumps(c, sort_keys=True): c for c in out}.values(), key=lambda c: json.dumps(c, sort_keys=True))


def _signature(kernel, acc):
    ptr = _PTR[acc]
    types = dict(
        meta_ptr="*i64",
        work_ptr="*i32",
        out_ptr=ptr,
        split_stride="i64",
        hyper_ptr=ptr,
        n_items="i32",
        m_ptr=ptr,
        scratch_ptr=ptr,
        P_MAX="i32",
        # the guard's blend kernels: per-layer tables, partial sums and results in float64
        layer_ptr="*i64",
        coef_ptr="*fp64",
        weight_ptr="*fp64",
        part_ptr="*fp64",
        result_ptr="*fp64",
        movable_ptr="*i1",
        finite_ptr="*i1",
        scale_ptr="*fp64",
        g_norm_ptr="*fp64",
        rule_ptr="*fp64",
        job_ptr="*i64",
        alpha_ptr="*fp64",
        top="fp32",
        n_layers="i32",
        n_splits="i32",
        numel="i32",
    )
    for name in kernel.arg_names:  # the guard's p × p blocks
        if name.endswith("_ptr") and name not in types:
            types[name] = ptr
    return {name: types.get(name, "constexpr") for name in kernel.arg_names}


def compile_one(name, consts, config, arch):
    """Compile one configuration; return a JSON-able report."""
    module = {"tc": "tc_step", "guard": "guard", "mid": "products"}.get(name.split("_")[0], "fgd_step")
    module = {"gram_gather_kernel": "blocks", "mid_prep_kernel": "middle"}.get(name, module)
    kernel = getattr(_kernels(module), name)
    blocks = {k: v for k, v in config.items() if not k.startswith("num_")}
    consts = dict(consts, **blocks)
    consts = {k: (getattr(tl, v) if k in ("DTYPE", "ACC") else v) for k, v in consts.items()}
    src = ASTSource(fn=kernel, signature=_signature(kernel, config_acc(consts)), constexprs=consts)
    options = {k: v for k, v in config.items() if k.startswith("num_")}
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    usage = _resource_usage(compiled.asm["cubin"])
    usage["sass"] = _sass_ops(compiled.asm["cubin"])
    return dict(
        kernel=name,
        arch=arch,
        config={k: str(v) for k, v in consts.items()},
        shared=compiled.metadata.shared,
        mma="mma" in compiled.asm["ptx"],
        **usage,
    )


def config_acc(consts):
    return "float64" if consts.get("ACC") == tl.float64 else "float32"


TENSOR_CORE_OP = {90: "HGMMA", 80: "HMMA"}  # the SASS instruction of a TF32 product per target


def expects_tensor_cores(config: dict) -> bool:
    """Whether the products of this configuration must run on tensor cores: the tensor-core
    Gram and update kernels, and the CUDA-core kernels at a float32 tensor-core precision (the
    tensor-core split pass has no ``PRECISION``: it has no products)."""
    return config.get("PRECISION") in ("tf32", "tf32x3") and config.get("ACC", "fp32") == "fp32"


def _cuobjdump(cubin: bytes, *flags: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *flags, f.name], capture_output=True, text=True, check=True).stdout


def _sass_ops(cubin: bytes) -> dict:
    """Counts of the product instructions and of 16-byte global loads and stores in the SASS."""
    return sass_counts(_cuobjdump(cubin, "-sass"))


def sass_counts(sass: str) -> dict:
    """Counts in a SASS listing: tensor-core products (``HGMMA``, ``HMMA``), CUDA-core FMAs
    (``FFMA``, ``DFMA``) and 16-byte global loads (``LDG``, ``LDGSTS``) and stores (``STG``)."""
    count = lambda pattern: len(re.findall(pattern, sass))  # noqa: E731
    return dict(
        hgmma=count(r"\bHGMMA\."),
        hmma=count(r"\bHMMA\."),
        ffma=count(r"\bFFMA\b"),
        dfma=count(r"\bDFMA\b"),
        loads_128=count(r"\b(?:LDG|LDGSTS)\.E\S*\.128\b"),
        stores_128=count(r"\bSTG\.E\S*\.128\b"),
    )


def _resource_usage(cubin: bytes) -> dict:
    text = _cuobjdump(cubin, "--dump-resource-usage")
    line = [ln for ln in text.splitlines() if "REG:" in ln][-1]
    fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
    return dict(registers=int(fields["REG"]), stack=int(fields["STACK"]))


def tensor_cores_ok(r: dict) -> bool:
    """A tensor-core configuration's SASS has tensor-core products (HGMMA on sm_90, HMMA on sm_80;
    the middle's products may take HMMA on sm_90 too: its 32-row tiles are below wgmma's 64)."""
    if "error" in r or not expects_tensor_cores(r["config"]):
        return True
    if r["kernel"] in ("mid_mm_kernel", "mid_jobs_kernel"):
        return r["sass"]["hgmma"] + r["sass"]["hmma"] > 0
    return r["sass"][TENSOR_CORE_OP[r["arch"]].lower()] > 0


def failures(results: list) -> list:
    """The reports that fail the check: a compile error, a spill (stack in use), or a tensor-core
    configuration without tensor-core products."""
    return [r for r in results if "error" in r or r.get("stack", 0) != 0 or not tensor_cores_ok(r)]


def _job(args):
    try:
        return compile_one(*args)
    except Exception as exc:  # reported, and fails the run
        name, consts, _, arch = args
        return dict(kernel=name, arch=arch, config={k: str(v) for k, v in consts.items()}, error=repr(exc))


def select(configs: list, *, subset: bool = False, smoke: bool = False) -> list:
    """``configs`` (from :func:`configurations`) reduced: ``subset`` keeps float32/float64
    parameters; ``smoke`` keeps every tensor-core configuration and the first of every other
    (kernel, dtype)."""
    if subset:
        configs = [c for c in configs if c[1].get("DTYPE", "float32") in ("float32", "float64")]
    if smoke:
        seen, kept = set(), []
        for name, consts, cfg in configs:
            key = (name, consts.get("DTYPE", consts.get("ACC", "float32")))  # (float64 blocks too)
            if name.startswith("tc_") or key not in seen:
                kept.append((name, consts, cfg))
                seen.add(key)
        configs = kept
    return configs


def main(argv=None) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("kernels/aot.py: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)", file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    ap.add_argument("--subset", action="store_true", help="only float32 and float64 parameters (API-drift check)")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="every tensor-core configuration and one per other (kernel, dtype): a quick check of another Triton",
    )
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", help="write the per-configuration report here")
    args = ap.parse_args(argv)
    configs = select(configurations(), subset=args.subset, smoke=args.smoke)
    jobs = [(name, consts, config, arch) for arch in args.arch for name, consts, config in configs]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(_job, jobs))
    bad = failures(results)
    for r in results:
        status = r.get("error") or (
            f"regs {r['registers']:3d} stack {r['stack']} shared {r['shared']} mma {r['mma']} sass {r['sass']}"
        )
        print(f"sm_{r['arch']} {r['kernel']:13s} {json.dumps(r['config'], sort_keys=True)}: {status}")
    print(f"triton {triton.__version__}: {len(results)} compiled, {len(bad)} failed, spilled or missed tensor cores")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
