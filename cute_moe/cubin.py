"""Resource usage and SASS instruction mix of a cubin, with no GPU.

Per kernel (an ELF ``.text.<name>`` section of the cubin):

* registers: the ``EIATTR_REGCOUNT`` attribute of the cubin's ``.nv.info``
  section, which names the kernel by symbol index;
* static shared memory: the size of ``.nv.shared.<name>``; the dynamic shared
  memory a kernel requests at launch is added by the caller (the kernel object
  records it), since it is not in the cubin;
* SASS: ``nvdisasm -c`` (from the ``nvidia-cuda-nvdisasm`` wheel) on the cubin;
  instruction mnemonics are the opcode's first dot-separated token (``QGMMA``,
  ``UTMALDG``, ``LDL``, ``STL``), predicates stripped;
* spill bytes: the bytes stored to local memory by ``STL`` instructions (the
  static measure ptxas reports as spill stores; a kernel that keeps an array in
  local memory on purpose would show here too).
"""

from __future__ import annotations

import collections
import glob
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_x]+)*)")
_STL_WIDTH = {"": 4, "U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


@dataclass
class KernelReport:
    name: str
    registers: int
    smem_bytes: int
    spill_bytes: int
    sass_counts: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "registers": self.registers,
            "smem_bytes": self.smem_bytes,
            "spill_bytes": self.spill_bytes,
            "sass_counts": dict(sorted(self.sass_counts.items())),
        }


class _Elf:
    """The few parts of a little-endian ELF64 cubin that resource usage needs."""

    def __init__(self, blob: bytes):
        if blob[:4] != b"\x7fELF" or blob[4] != 2:
            raise ValueError("not an ELF64 cubin")
        self.blob = blob
        shoff = struct.unpack_from("<Q", blob, 0x28)[0]
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)
        headers = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize) for i in range(shnum)]
        names_off = headers[shstrndx][4]
        # name -> (offset, size)
        self.sections = {self._cstr(names_off + h[0]): (h[4], h[5]) for h in headers}

    def _cstr(self, off: int) -> str:
        return self.blob[off : self.blob.index(b"\0", off)].decode()

    def data(self, name: str) -> bytes:
        off, size = self.sections[name]
        return self.blob[off : off + size]

    def symbol_names(self) -> list[str]:
        strtab_off = self.sections[".strtab"][0]
        symtab = self.data(".symtab")
        return [self._cstr(strtab_off + struct.unpack_from("<I", symtab, i)[0]) for i in range(0, len(symtab), 24)]

    def register_counts(self) -> dict:
        """kernel name -> registers per thread, from EIATTR_REGCOUNT entries."""
        symbols, info, counts, i = self.symbol_names(), self.data(".nv.info"), {}, 0
        while i + 4 <= len(info):
            fmt, attr = info[i], info[i + 1]
            if fmt != _EIFMT_SVAL:  # fixed 2-byte payload
                i += 4
                continue
            size = struct.unpack_from("<H", info, i + 2)[0]
            if attr == _EIATTR_REGCOUNT:
                symbol, regs = struct.unpack_from("<II", info, i + 4)
                counts[symbols[symbol]] = regs
            i += 4 + size
        return counts


_EIFMT_SVAL = 0x04
_EIATTR_REGCOUNT = 0x2F


def nvdisasm_path() -> str:
    found = shutil.which("nvdisasm")
    if found:
        return found
    for root in sys.path:
        hits = glob.glob(os.path.join(root, "nvidia", "cu*", "bin", "nvdisasm")) + glob.glob(
            os.path.join(root, "nvidia", "cuda_nvdisasm", "bin", "nvdisasm")
        )
        if hits:
            return hits[0]
    raise FileNotFoundError("nvdisasm not found: pip install 'nvidia-cuda-nvdisasm>=13.4' (the [test] extra)")


def disassemble(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([nvdisasm_path(), "-c", f.name], capture_output=True, text=True, check=True)
    return out.stdout


def _split_functions(sass: str) -> dict:
    """kernel name -> list of SASS lines, from nvdisasm's per-section output."""
    funcs: dict = collections.defaultdict(list)
    current = None
    for line in sass.splitlines():
        m = re.match(r"\s*\.section\s+\.text\.(\S+?),", line)
        if m:
            current = m.group(1)
            continue
        if current is not None:
            funcs[current].append(line)
    return funcs


def analyse_cubin(cubin: bytes, dynamic_smem_bytes: int = 0) -> list[KernelReport]:
    elf = _Elf(cubin)
    registers = elf.register_counts()
    lines_by_kernel = _split_functions(disassemble(cubin))
    reports = []
    for sec_name in elf.sections:
        if not sec_name.startswith(".text."):
            continue
        name = sec_name[len(".text.") :]
        counts: collections.Counter = collections.Counter()
        spill = 0
        for line in lines_by_kernel.get(name, []):
            m = _SASS_LINE.match(line)
            if not m:
                continue
            op, suffixes = m.group(1), m.group(2)
            counts[op] += 1
            if op == "STL":
                width = next((s for s in suffixes.split(".") if s in _STL_WIDTH and s), "")
                spill += _STL_WIDTH[width]
        static_smem = elf.sections.get(f".nv.shared.{name}", (0, 0))[1]
        reports.append(
            KernelReport(
                name=name,
                registers=registers.get(name, 0),
                smem_bytes=static_smem + dynamic_smem_bytes,
                spill_bytes=spill,
                sass_counts=dict(counts),
            )
        )
    return reports
