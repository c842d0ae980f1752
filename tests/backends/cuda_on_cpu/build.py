"""Test-only: build ``backends/_cupy_kernels.cu`` for the CPU and launch its kernels.

The kernel source is compiled as it ships, with g++ and ``cuda_on_cpu.h`` (CUDA's
builtins as C++, every CUDA thread a fiber). Only its inline PTX is rewritten, each
``asm`` statement into a call of the ``ptx_*`` function named after its
instructions (``mul.rn.f32`` becomes ``ptx_mul_rn_f32``); an instruction the header
does not know, or a count of statements other than :data:`ASM_STATEMENTS`, stops
the build. Each kernel gets a C launcher, ``sc_cpu_launch_<name>(grid, block,
seed, args...)``, found from the preprocessed source, so a kernel added to the
.cu is launchable here without a change.

    lib = build(kernel_source())          # cached per source text
    lib.launch("sc_unscale_float32", grid, block, (table, n_chunks, ...))
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
#: The asm statements the kernel source holds: a change to it changes this on purpose.
ASM_STATEMENTS = 12
FLAGS = ("-std=c++17", "-O1", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared")

_ASM = re.compile(r"\basm\s*\((?P<body>(?:[^;]|;(?!\s*\n))*?)\)\s*;", re.S)
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')
_OPERAND = re.compile(r'"=?(?P<kind>[fdh])"\s*\((?P<expr>[^()]*)\)')
#: Instruction sequences that are one function (the predicate of a select).
_SEQUENCES = {
    ("setp.gt.f32 p, %1, 0f3F800000", "selp.f32 %0, 0f3F800000, %1, p"): ("ptx_min_one_f32", 1),
}
#: One instruction: its opcode and how many inputs it takes (operands %1...%n).
_OPCODES = {
    "mul.rn.f32": 2,
    "add.rn.f32": 2,
    "div.rn.f32": 2,
    "cvt.f64.f32": 1,
    "cvt.rn.f32.f64": 1,
    "fma.rn.f64": 3,
    "add.rn.f64": 2,
    "sqrt.rn.f64": 1,
    "cvt.f32.f16": 1,
    "cvt.rn.f16.f32": 1,
}


class BuildError(RuntimeError):
    """The kernel source holds something the CPU build does not know."""


def _instructions(template: str) -> tuple[str, ...]:
    text = bytes(template, "utf-8").decode("unicode_escape")
    lines = [ln.strip().rstrip(";").strip() for ln in re.split(r"[;\n]", text)]
    return tuple(ln for ln in lines if ln and ln not in ("{", "}") and not ln.startswith(".reg"))


def _call(statement: str) -> str:
    """The C++ call that stands for one asm statement's body (``asm(...)`` inside)."""
    parts = statement.split(":")
    if len(parts) != 3:
        raise BuildError(f"asm statement without one output and its inputs: {statement!r}")
    template = "".join(_STRING.findall(parts[0]))
    outputs = _OPERAND.findall(parts[1])
    inputs = [expr.strip() for _, expr in _OPERAND.findall(parts[2])]
    if len(outputs) != 1:
        raise BuildError(f"asm statement with {len(outputs)} outputs: {statement!r}")
    instructions = _instructions(template)
    if instructions in _SEQUENCES:
        name, arity = _SEQUENCES[instructions]
    elif len(instructions) == 1:
        opcode, _, operands = instructions[0].partition(" ")
        if opcode not in _OPCODES:
            raise BuildError(f"no CPU function for the PTX instruction {opcode!r}")
        arity = _OPCODES[opcode]
        expected = ", ".join(f"%{i}" for i in range(arity + 1))
        if operands.replace(" ", "") != expected.replace(" ", ""):
            raise BuildError(f"{opcode} with operands {operands!r}, not {expected!r}")
        name = "ptx_" + opcode.replace(".", "_")
    else:
        raise BuildError(f"no CPU function for the PTX sequence {instructions!r}")
    if len(inputs) != arity:
        raise BuildError(f"{name} takes {arity} inputs, the asm statement gives {len(inputs)}")
    return f"{outputs[0][1].strip()} = {name}({', '.join(inputs)})"


def rewrite(source: str) -> str:
    """``source`` with every asm statement replaced by its ptx_* call.

    Raises:
        BuildError: An instruction has no CPU function, or the number of asm
            statements is not :data:`ASM_STATEMENTS`.
    """
    count = 0

    def replace(match: re.Match[str]) -> str:
        nonlocal count
        count += 1
        return _call(match.group("body")) + ";"

    out = _ASM.sub(replace, source)
    if count != ASM_STATEMENTS:
        raise BuildError(
            f"the kernel source holds {count} asm statements, the CPU build knows "
            f"{ASM_STATEMENTS}: give each new instruction a ptx_* function in cuda_on_cpu.h "
            f"and update ASM_STATEMENTS"
        )
    return out


_KERNEL = re.compile(r'extern\s+"C"\s+void\s+(sc_\w+)\s*\(([^)]*)\)\s*\{')


def _kernels(preprocessed: str) -> dict[str, list[tuple[str, str]]]:
    """Each kernel's parameters, ``(type, name)``, from the preprocessed source."""
    out = {}
    for name, params in _KERNEL.findall(preprocessed):
        pairs = []
        for param in params.split(","):
            m = re.fullmatch(r"\s*(.*?)\s*(\w+)\s*", param)
            assert m is not None, param
            pairs.append((m.group(1), m.group(2)))
        out[name] = pairs
    return out


def _launcher(name: str, params: list[tuple[str, str]]) -> str:
    args = ", ".join(f"{t} {n}" for t, n in params)
    names = ", ".join(n for _, n in params)
    return (
        f'extern "C" int sc_cpu_launch_{name}(unsigned int grid, unsigned int block, '
        f"unsigned int seed, {args}) {{\n"
        f"    return sc_cpu::run(grid, block, seed, [=]() {{ {name}({names}); }});\n}}\n"
    )


def _ctype(c_type: str) -> Any:
    if "*" in c_type:
        return ctypes.c_void_p
    base = c_type.replace("const", "").strip()
    return {"int": ctypes.c_int, "float": ctypes.c_float}[base]


class CpuKernels:
    """The built library: ``launch(name, grid, block, args, seed=0)``."""

    def __init__(self, path: Path, kernels: dict[str, list[tuple[str, str]]]) -> None:
        self.path, self.kernels = path, kernels
        self._lib = ctypes.CDLL(str(path))
        self._lib.sc_cpu_error.restype = ctypes.c_char_p
        self._fns = {}
        for name, params in kernels.items():
            fn = getattr(self._lib, f"sc_cpu_launch_{name}")
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_uint] + [
                _ctype(t) for t, _ in params
            ]
            self._fns[name] = fn

    def launch(self, name: str, grid: int, block: int, args: Sequence[Any], seed: int = 0) -> None:
        """Run kernel ``name`` over ``grid`` blocks of ``block`` threads; NumPy arrays
        pass their address, ``None`` a null pointer. A seed other than 0 shuffles the
        order in which threads run between barriers.

        Raises:
            RuntimeError: The threads of a block did not all reach the same barrier.
        """
        values = [a.ctypes.data if isinstance(a, np.ndarray) else a for a in args]
        if self._fns[name](grid, block, seed, *values) != 0:
            raise RuntimeError(f"{name}: {self._lib.sc_cpu_error().decode()}")


def compiler() -> str | None:
    """The C++ compiler the build uses, or ``None`` where there is none."""
    return shutil.which("g++") or shutil.which("c++")


@functools.cache
def build(source: str) -> CpuKernels:
    """``source`` (the kernel source) compiled for the CPU, in a temporary folder.

    Raises:
        BuildError: See :func:`rewrite`; or the compiler failed (its output attached).
    """
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler (g++) on PATH")
    folder = Path(tempfile.mkdtemp(prefix="sc-cuda-on-cpu-"))
    unit = folder / "kernels.cpp"
    body = f'#include "cuda_on_cpu.h"\n#line 1 "_cupy_kernels.cu"\n{rewrite(source)}\n'
    unit.write_text(body, encoding="utf-8")
    pre = subprocess.run(
        [cxx, "-E", "-P", "-std=c++17", f"-I{HERE}", str(unit)],
        capture_output=True,
        text=True,
        check=False,
    )
    if pre.returncode != 0:
        raise BuildError(f"g++ -E failed:\n{pre.stderr}")
    kernels = _kernels(pre.stdout)
    launchers = "".join(_launcher(n, p) for n, p in kernels.items())
    unit.write_text(
        body + "\n#include <functional>\nnamespace sc_cpu { int run(unsigned int, unsigned int, "
        "unsigned int, const std::function<void()>&); }\n" + launchers,
        encoding="utf-8",
    )
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    lib = folder / f"sc_kernels_{digest}.so"
    out = subprocess.run(
        [
            cxx,
            *FLAGS,
            "-Wno-unknown-pragmas",
            f"-I{HERE}",
            "-o",
            str(lib),
            str(unit),
            str(HERE / "cuda_on_cpu_runtime.cpp"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise BuildError(f"g++ failed:\n{out.stderr}")
    return CpuKernels(lib, kernels)


class HostGpu:
    """The CuPy backend's ``_Gpu``, on the CPU: its launch code runs unchanged.

    Arrays are CuPy arrays over host memory (``UnownedMemory`` at a NumPy buffer's
    address, so CuPy itself computes nothing on them), kernels are launched in the
    CPU build, and the few steps ``_Gpu`` does with CuPy kernels (the copies, the
    device scale's check) are done with NumPy on the same memory. ``max_grid`` caps
    the grid as a GPU's SM count does; ``seed`` shuffles the threads between
    barriers (0: thread order).
    """

    def __init__(self, kernels: CpuKernels, cupy: Any, *, max_grid: int = 8, seed: int = 0) -> None:
        self.kernels, self.cupy = kernels, cupy
        self.grid_cap, self.seed = max_grid, seed
        self.launches: list[tuple[str, int]] = []

    # -- memory
    def view(self, host: np.ndarray) -> Any:
        """A CuPy array over ``host``'s memory (``host`` kept alive by it)."""
        from cupy.cuda import memory

        mem = memory.UnownedMemory(host.ctypes.data, max(host.nbytes, 1), host, device_id=0)
        return self.cupy.ndarray(
            host.shape, dtype=host.dtype, memptr=memory.MemoryPointer(mem, 0), strides=host.strides
        )

    @staticmethod
    def host(a: Any) -> np.ndarray:
        """The NumPy view of a CuPy array made by :meth:`view` (or a view of one)."""
        if a.size == 0:
            return np.empty(a.shape, a.dtype)
        span = sum((n - 1) * s for n, s in zip(a.shape, a.strides, strict=True)) + a.dtype.itemsize
        buf = (ctypes.c_char * int(span)).from_address(a.data.ptr)
        flat = np.frombuffer(buf, dtype=np.uint8)
        return np.lib.stride_tricks.as_strided(flat.view(a.dtype), a.shape, a.strides)

    def upload(self, host: np.ndarray) -> Any:
        return self.view(np.array(host, copy=True))

    def zeros(self, shape: Any, dtype: Any) -> Any:
        return self.view(np.zeros(shape, dtype))

    def empty(self, shape: Any, dtype: Any) -> Any:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape))
        raw = np.full(max(n, 1) * dtype.itemsize, 0xFF, np.uint8)  # garbage: never read
        return self.view(raw[: n * dtype.itemsize].view(dtype).reshape(shape))

    def contiguous(self, a: Any) -> Any:
        return self.view(np.ascontiguousarray(self.host(a)))

    def copy(self, dst: Any, src: Any) -> None:
        self.host(dst)[...] = self.host(src)

    def copy_unless(self, src: Any, skip: Any, dst: Any) -> None:
        if not bool(self.host(skip)):
            self.copy(dst, src)

    def checked_scale(self, scale: Any) -> Any:
        s = self.host(scale)
        ok = np.isfinite(s) & (s >= np.float32(np.finfo(np.float32).tiny))
        return self.view(np.where(ok, s, np.float32(np.nan)).astype(np.float32))

    # -- kernels and device
    def function(self, device: int, name: str) -> Any:
        def launch(grid: tuple[int], block: tuple[int], args: Sequence[Any]) -> None:
            values = []
            for a in args:
                if isinstance(a, self.cupy.ndarray):
                    values.append(a.data.ptr)
                elif isinstance(a, np.uint64):  # the null device scale
                    values.append(None if int(a) == 0 else int(a))
                else:
                    values.append(a.item() if isinstance(a, np.generic) else a)
            self.launches.append((name, grid[0]))
            self.kernels.launch(name, grid[0], block[0], values, seed=self.seed)

        return launch

    def max_grid(self, device: int) -> int:
        return self.grid_cap

    @staticmethod
    def capturing() -> bool:
        return False

    @staticmethod
    def current() -> int:
        return 0

    @staticmethod
    def use(device: int) -> Any:
        import contextlib

        return contextlib.nullcontext()


def host_namespace(gpu: HostGpu, base: type) -> Any:
    """The CuPy backend's namespace (``base``) with the flag operations done by NumPy on
    :class:`HostGpu` arrays: what the core's ``select``, ``any`` and ``to_bool`` need.
    (Arithmetic on CuPy arrays, as the device transition does, still needs a GPU.)"""

    def host(a: Any) -> Any:
        return gpu.host(a) if isinstance(a, gpu.cupy.ndarray) else a

    class HostNamespace(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def flag(value: bool) -> Any:
            return gpu.view(np.array(bool(value)))

        @staticmethod
        def read(flag: Any) -> bool:
            return bool(gpu.host(flag))

        @staticmethod
        def logical_or(a: Any, b: Any) -> Any:
            return gpu.view(np.array(np.logical_or(host(a), host(b))))

        @staticmethod
        def where(cond: Any, a: Any, b: Any) -> Any:
            return gpu.view(np.array(np.where(host(cond), host(a), host(b))))

        @staticmethod
        def asarray(value: Any, dtype: Any = None) -> Any:
            if isinstance(value, gpu.cupy.ndarray):
                return value
            return gpu.view(np.array(value, dtype=dtype))

    return HostNamespace()
