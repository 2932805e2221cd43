"""``python -m cute_moe.inspect OP --arch {sm_90a,sm_100a} [--json]``

Compiles the CuTe DSL kernel(s) behind a cute_moe op for a representative
problem, with no GPU, and prints per kernel: name, registers, shared memory
bytes, spill bytes and SASS instruction counts by mnemonic.  ``--json`` prints
one object ``{"op", "arch", "kernels": [{"variant", "name", "registers", "smem_bytes",
"spill_bytes", "sass_counts"}]}`` (``variant``: the compiled configuration a kernel belongs to).  Exits 2 for an op with no kernel yet.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from .compiler import SUPPORTED_ARCHS, import_cute


def inspect_op(op: str, arch: str) -> dict:
    import_cute(arch)  # pins the DSL's default target before anything else imports cutlass
    from .cubin import analyse_cubin
    from .kernels import KERNEL_MODULES

    module = importlib.import_module(KERNEL_MODULES[op])
    kernels = []
    for variant, compiled, dynamic_smem in module.inspect_variants(arch):
        cubin = compiled.artifacts.CUBIN
        if not cubin:
            raise RuntimeError(f"{variant}: the DSL returned no cubin")
        for report in analyse_cubin(cubin, dynamic_smem):
            kernels.append({"variant": variant, **report.as_dict()})
    return {"op": op, "arch": arch, "kernels": kernels}


def _format_table(result: dict) -> str:
    lines = [f"{result['op']} on {result['arch']}"]
    for k in result["kernels"]:
        lines.append(f"\n{k['variant']}\n  kernel     {k['name']}")
        lines.append(f"  registers  {k['registers']}\n  smem bytes {k['smem_bytes']}\n  spill bytes {k['spill_bytes']}")
        top = sorted(k["sass_counts"].items(), key=lambda kv: (-kv[1], kv[0]))
        lines.append("  sass       " + ", ".join(f"{op} {n}" for op, n in top))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from .kernels import KERNEL_MODULES
    from .functional import __all__ as OP_NAMES

    parser = argparse.ArgumentParser(prog="python -m cute_moe.inspect", description=__doc__.split("\n\n")[1])
    parser.add_argument("op", help=f"one of: {', '.join(OP_NAMES)}")
    parser.add_argument("--arch", required=True, choices=SUPPORTED_ARCHS)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.op not in OP_NAMES:
        print(f"cute_moe.inspect: unknown op {args.op!r}; ops: {', '.join(OP_NAMES)}", file=sys.stderr)
        return 2
    if args.op not in KERNEL_MODULES:
        print(
            f"cute_moe.inspect: cute_moe.{args.op} has no CuTe DSL kernel yet "
            f"(ops with kernels: {', '.join(sorted(KERNEL_MODULES))})",
            file=sys.stderr,
        )
        return 2
    result = inspect_op(args.op, args.arch)
    print(json.dumps(result, indent=1) if args.json else _format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
