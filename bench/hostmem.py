"""What a CPU rank holds: the benches' peak memory on CPU ([Note: CPU peak]).

[Note: CPU peak] On CUDA the benches read the caching allocator: bytes of live tensors and their
high-water mark since a reset. CPU tensors come from malloc, which keeps no high-water mark (mallinfo2's
`usmblks` is always 0), so a CPU peak is made of two counters of the rank's own process:
- held: glibc's bytes in use (mallinfo2: `uordblks`, the heap's, plus `hblkhd`, blocks mmapped on
  their own), read before and after a system's own calls and the change tallied to it, as the CUDA
  numbers are. Allocated, not necessarily touched: a buffer malloc mapped and nobody wrote counts in
  full, as it does on CUDA;
- rise: Linux's high-water mark of the process's resident memory (VmHWM), reset (5 to
  /proc/self/clear_refs) after free heap pages went back to the kernel (malloc_trim), read after the
  calls: how far resident memory rose above where it stood.
Both count all that malloc hands out (tensors, C++ objects, large Python objects), not tensors only;
the rise is counted in pages (4 KiB) and also covers pages that Python's small-object arenas or a
library loaded during the calls first touch. One-time allocations of a library count as the first
system's that makes them: gather_release runs a throwaway step of a plain model first (`prime`: torch
imports its compiler stack, about 24 MiB, at an optimizer's first step), but the first DeepSpeed engine
of a process still carries DeepSpeed's (about 15 MiB in the 2-rank CPU smoke run: z3ext's peak with
--isolated against without); stock's, built first, dwarfs them (DeepSpeed allocates its 5e8-element
reduce bucket at initialize, 1.9 GiB in fp32, untouched on a small model but allocated). Where a counter is missing (not Linux, not glibc, a kernel
that refuses the reset) `HostMemory.error` says which, and the benches print "n/a (CPU)".
"""
import ctypes


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]


def _status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise KeyError(key)


class HostMemory:

    def __init__(self):
        self.error = None
        try:
            self.libc = ctypes.CDLL("libc.so.6")
            self.libc.mallinfo2.restype = _Mallinfo2
            self.libc.malloc_trim.argtypes = [ctypes.c_size_t]
            _status("VmHWM")
            self.reset_peak()  # a kernel may refuse the write (no /proc, a sandbox)
        except (OSError, AttributeError, KeyError) as e:
            self.error = f"no glibc mallinfo2 or Linux resident high-water mark here ({type(e).__name__}: {e})"[:200]

    def in_use(self):
        """Bytes malloc has handed out and not taken back. No garbage collection here: with a few engines
        in the process one takes 0.3 s; the benches collect where they already do."""
        m = self.libc.mallinfo2()
        return m.uordblks + m.hblkhd

    def reset_peak(self):
        """Hands free heap pages back, restarts the high-water mark here; returns resident bytes now."""
        self.libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status("VmRSS")

    def peak(self):
        """Highest resident bytes since `reset_peak`."""
        return _status("VmHWM")
