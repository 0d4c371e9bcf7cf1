"""Compile every kernel variant the launchers produce on a GPU, ahead of time, no GPU needed.

Run as ``python -m tests.kernels.aot_compile ARCH`` in a fresh process with
TRITON_INTERPRET unset (triton reads it when the kernels are decorated). Prints one JSON
line per variant: name, ok or error, the target, ptxas' registers / shared memory / spills,
the tensor-core instruction its dots compile to, and whether the flag atomics have system
scope.

Each variant is compiled as the JIT would compile that launch: the launcher's block sizes,
warps and stages for this arch (``AOT_EXAMPLES`` of each kernel module), ints equal to 1
(unit strides) as constexprs, and the alignment the JIT sees at run time: every pointer,
and every int the kernel specialises, divisible by 16 (fresh torch allocations, the
symmetric data regions, and LLM shapes). Per-call ints (``do_not_specialize``) get none.
"""

import contextlib
import io
import json
import os
import re
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="fusedpar_aot_")  # ptxas must run

import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fusedpar.kernels import aot_examples  # noqa: E402
from fusedpar.kernels.signal import PER_CALL_ARGS  # noqa: E402

PTXAS = re.compile(r"Used (\d+) registers")
SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
# a 2-byte global load or store (not a vector of them): flags and pointers are wider
SCALAR_16BIT = re.compile(r"\b(?:ld|st)\.global(?:\.[a-z]+)*\.[bfsu]16\b")


def attrs_for(kernel, signature: dict) -> dict:
    """Alignment the JIT would specialise on (see the module docstring)."""
    attrs = {}
    for i, (name, kind) in enumerate(signature.items()):
        param = kernel.params[i]
        assert param.name == name, f"{kernel.fn.__name__}: signature order differs at {name}"
        aligned = kind.startswith("*") or (kind in ("i32", "i64") and not param.do_not_specialize)
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def compile_variant(kernel, signature, constexprs, options, target):
    sig = {name: ("constexpr" if name in constexprs else kind)
           for name, kind in {**signature, **{k: "constexpr" for k in constexprs}}.items()}
    sig = {p.name: sig[p.name] for p in kernel.params}  # the kernel's parameter order
    src = ASTSource(kernel, sig, constexprs, attrs_for(kernel, sig))
    log = io.StringIO()
    knobs.nvidia.dump_ptxas_log = True
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(src, target=target, options={
            k: v for k, v in options.items() if k in ("num_warps", "num_stages")})
    text = log.getvalue()
    used, spills = PTXAS.search(text), SPILLS.findall(text)
    ptx = compiled.asm["ptx"]
    return {"ok": True,
            "target": next(line for line in ptx.splitlines() if line.startswith(".target")).split()[1].rstrip(","),
            "regs": int(used.group(1)) if used else None,
            "smem": compiled.metadata.shared,
            "spill_bytes": sum(int(a) + int(b) for a, b in spills) if spills else None,
            # per-call arguments the JIT would specialise (an int equal to 1 or divisible by
            # 16 would compile a new binary mid-training): must be none
            "specialised_per_call": sorted(p.name for p in kernel.params
                                           if p.name in PER_CALL_ARGS and not p.do_not_specialize),
            # Hopper's tensor-core matmul (wgmma) or the older mma.sync, where a variant has dots
            "mma": ("wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx
                    else None),
            # 2-byte scalar global accesses: an access pattern the compiler could not prove
            # contiguous and 16-byte aligned moves one element per instruction
            "scalar_16bit": len(SCALAR_16BIT.findall(ptx)),
            # fp32 division that is not IEEE-rounded (``a / b`` in Triton compiles to it)
            "approx_div": len(re.findall(r"\bdiv\.(?:full|approx)(?:\.ftz)?\.f32\b", ptx)),
            "acquire_sys": "sys.acquire" in ptx or "acquire.sys" in ptx,
            "release_sys": "sys.release" in ptx or "release.sys" in ptx}


def main(arch: int) -> None:
    target = GPUTarget("cuda", arch, 32)
    for family, kernel, signature, constexprs, options in aot_examples():
        if options.get("arch", arch) != arch:
            continue
        shown = {k: v for k, v in constexprs.items() if k.isupper() or k.startswith("stride")}
        dtypes = sorted({v for k, v in signature.items() if v.startswith("*") and k != "pad_table"
                         and v != "*i64"} or {"-"})
        name = f"{family}.{kernel.fn.__name__}"
        row = {"name": name, "arch": arch, "triton": triton.__version__, "dtypes": ",".join(dtypes),
               "config": ",".join(f"{k}={v}" for k, v in shown.items()),
               "warps": options.get("num_warps", 4), "stages": options.get("num_stages", 3),
               "spills_ok": options.get("spills_ok", ""),
               "mma_sync_ok": options.get("mma_sync_ok", "")}
        try:
            row.update(compile_variant(kernel, signature, constexprs, options, target))
        except Exception as e:  # noqa: BLE001 - reported to the test
            row.update({"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]})
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
