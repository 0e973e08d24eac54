"""Compile recorded kernel launches for a GPU target without a GPU and count their global loads (a helper of
tests/test_triton_compile.py, run as a script so that another Triton can be put first on its path).

stdin: JSON {"target": [backend, arch, warp_size], "launches": [{kernel, signature, constexprs, divisible}]}, one
entry per distinct launch (signature: parameter name → Triton type; divisible: indices of arguments Triton's
launcher would mark divisible by 16). stdout: JSON {"triton": version, "kernels": [{kernel, constexprs, loads}]},
loads counting each PTX global load or async copy instruction by its form (ld.global.b16, ld.global.v4.b32,
cp.async.cg.shared.global.16, ...)."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter


def loads(ptx: str) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for line in ptx.splitlines():
        m = re.search(r"\b(ld\.global[.\w]*|cp\.async\.\w+\.shared\.global)\b(.*)", line)
        if not m:
            continue
        form = m.group(1)
        if form.startswith("cp.async"):
            size = re.search(r",\s*(\d+)\s*(?:,|;)", m.group(2))  # cp.async.cg.shared.global [dst], [src], 16
            form += f".{size.group(1) if size else '?'}"
        counts[form] += 1
    return dict(counts)


def main() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from backends import triton_kernels, triton_run_kernels

    spec = json.load(sys.stdin)
    target = GPUTarget(*spec["target"])
    out = []
    for launch in spec["launches"]:
        fn = getattr(triton_kernels, launch["kernel"], None) or getattr(triton_run_kernels, launch["kernel"])
        signature = dict(launch["signature"])
        for name in launch["constexprs"]:
            signature[name] = "constexpr"
        attrs = {(i,): [["tt.divisibility", 16]] for i in launch["divisible"]}
        src = ASTSource(fn=fn, signature=signature, constexprs=launch["constexprs"], attrs=attrs)
        compiled = triton.compile(src, target=target)
        out.append({"kernel": launch["kernel"], "constexprs": launch["constexprs"], "loads": loads(compiled.asm["ptx"])})
    json.dump({"triton": triton.__version__, "kernels": out}, sys.stdout)


if __name__ == "__main__":
    main()
