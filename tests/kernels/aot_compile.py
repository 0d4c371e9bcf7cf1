"""Compile every registered Triton kernel ahead of time for one GPU target, no GPU needed.

Run as ``python -m tests.kernels.aot_compile ARCH`` in a fresh process with
TRITON_INTERPRET unset (triton reads it when the kernels are decorated). Prints one JSON
line per kernel: name, ok, error, and a few facts of the produced code.
"""

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fusedpar.kernels import aot_examples  # noqa: E402


def main(arch: int) -> None:
    target = GPUTarget("cuda", arch, 32)
    for family, kernel, signature, constexprs in aot_examples():
        sig = dict(signature, **{name: "constexpr" for name in constexprs})
        name = f"{family}.{kernel.fn.__name__}[{','.join(f'{k}={v}' for k, v in signature.items() if k.endswith('_ptr'))}]"
        try:
            compiled = triton.compile(ASTSource(kernel, sig, constexprs), target=target)
            ptx = compiled.asm["ptx"]
            target_line = next(line for line in ptx.splitlines() if line.startswith(".target"))
            row = {"name": name, "ok": True, "cubin_bytes": len(compiled.asm["cubin"]),
                   "target": target_line.split()[1].rstrip(","),
                   "acquire_sys": "sys.acquire" in ptx or "acquire.sys" in ptx,
                   "release_sys": "sys.release" in ptx or "release.sys" in ptx}
        except Exception as e:  # noqa: BLE001 - reported to the test
            row = {"name": name, "ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
