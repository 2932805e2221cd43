"""Programmatic dependent launch (PDL) for the kernels of the MoE layer.

At decode sizes the layer is seven short kernels in a row, and each one's launch,
CTA placement and prologue would otherwise sit between the previous kernel's end
and its own first load.  Every kernel here is launched with ``use_pdl=True`` and
calls ``wait_then_release_dependents()`` before its first global-memory access:

* ``griddepcontrol.wait``: nothing after it runs until the previous kernel in the
  stream has completed and its writes are visible (a no-op when that kernel was
  not launched as a programmatic dependency);
* ``griddepcontrol.launch_dependents``: the next kernel may be launched now, so
  that its launch and prologue overlap this kernel's run.  It is issued after the
  wait, so at most one kernel waits behind a running one, and a dependent is only
  placed once every CTA of this grid is resident (no CTA of ours is starved).

Reads and writes both come after the wait, so a kernel never touches memory
(inputs, or a freed buffer the allocator hands out again) while its predecessor
still runs.  CUDA graphs keep the dependency as a programmatic edge.
"""
from __future__ import annotations

import cutlass.cute as cute

USE_PDL = True  # the launch attribute every kernel of this package passes


@cute.jit
def wait_then_release_dependents():
    cute.arch.griddepcontrol_wait()
    cute.arch.griddepcontrol_launch_dependents()
