"""Compiles the CUDA kernels for sm_90 and checks their resource use; no GPU needed.

1. where nvcc is found: nvcc -arch=sm_90 -cubin -std=c++17 -Xptxas -v on every executor_svc/kernels/*.cu,
   and on the single translation unit the CuPy backend hands to NVRTC (cupy_backend.kernel_source());
2. where libnvrtc is found (the toolkit, the nvidia-cuda-nvrtc wheel, or the one CuPy loads): that
   translation unit through NVRTC, as CuPy compiles it, with ptxas reporting into the program log;
3. a table per kernel: registers (per compiler), static and dynamic shared memory, spills, stack frame.

Either compiler alone gives a verdict; both are checked when both are there. Exit status 1 on a compile
error, a kernel missing from the output, any spill, or a non-zero stack frame in a hot kernel (every kernel
except the float32 row-wise path used for tests); 2 when neither compiler is found (nothing checked is
not a pass). --json writes {"status": "passed" | "failed" | "unchecked", ...} in every case.
Usage: python tools/kernels_check.py [--arch sm_90] [--nvcc PATH] [--json FILE]
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from executor_svc.attention.cupy_backend import (  # noqa: E402
    COMPILE_OPTIONS, KERNEL_DIR, KERNEL_FILES, decode_smem_bytes, kernel_names, kernel_source, prefill_smem_bytes,
)

# Kernels off the serving path: stack frames there are reported, not failed (spills still fail).
COLD_PREFIXES = ("paged_attention_rows_",)

ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?")


def find_nvcc(explicit: str | None) -> str | None:
    for candidate in (explicit, os.environ.get("NVCC"), shutil.which("nvcc")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def parse_ptxas(text: str) -> dict[str, dict]:
    """Kernel name -> registers, static smem, spill stores / loads, stack frame (bytes)."""
    kernels: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        if m := ENTRY.search(line):
            current = kernels.setdefault(m.group(1), {"registers": 0, "smem": 0, "spill_stores": 0,
                                                      "spill_loads": 0, "stack": 0})
        elif current is not None and (m := FRAME.search(line)):
            current["stack"], current["spill_stores"], current["spill_loads"] = map(int, m.groups())
        elif current is not None and (m := USED.search(line)):
            current["registers"] = int(m.group(1))
            current["smem"] = int(m.group(2) or 0)
    return kernels


def compile_nvcc(nvcc: str, source: Path, arch: str, out_dir: Path) -> tuple[bool, str]:
    cmd = [nvcc, f"-arch={arch}", "-cubin", *COMPILE_OPTIONS, "-Xptxas", "-v", "-I", str(KERNEL_DIR),
           "-o", str(out_dir / (source.stem + ".cubin")), str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.returncode == 0, proc.stdout + proc.stderr


def find_nvrtc() -> tuple[ctypes.CDLL, str] | None:
    """libnvrtc and its path: $NVRTC_LIBRARY, the nvidia-cuda-nvrtc wheel, the system, or the one CuPy loads."""
    paths = [os.environ.get("NVRTC_LIBRARY")]
    try:
        import nvidia  # the pip wheels: nvidia/cu13/lib/libnvrtc.so.13, nvidia/cuda_nvrtc/lib/libnvrtc.so.12

        for root in nvidia.__path__:
            paths += sorted(glob.glob(os.path.join(root, "**", "libnvrtc.so*"), recursive=True), reverse=True)
    except ImportError:
        pass
    for root in ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"):
        paths += sorted(glob.glob(os.path.join(root, "libnvrtc.so*")), reverse=True)
    paths += [ctypes.util.find_library("nvrtc")]
    for path in paths + [None]:
        if path is None:  # last resort: a GPU machine without the toolkit, where CuPy found one
            path = cupy_nvrtc_path()
        if not path or "builtins" in path or ".alt." in path:
            continue
        try:
            folder = os.path.dirname(path)
            # libnvrtc loads libnvrtc-builtins by name at compile time; make the one beside it resolvable.
            for builtins in sorted(glob.glob(os.path.join(folder, "libnvrtc-builtins.so*"))):
                if ".alt." not in builtins:
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(path), path
        except OSError:
            continue
    return None


def cupy_nvrtc_path() -> str | None:
    """The libnvrtc that CuPy loads (it compiles the kernels at run time), read off this process's mappings."""
    try:
        import cupy

        cupy.cuda.nvrtc.getVersion()
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libnvrtc.so" in line:
                    return line.split()[-1]
    except Exception:  # no CuPy, a CuPy that cannot load NVRTC, or no /proc
        return None
    return None


def compile_nvrtc(lib: ctypes.CDLL, source: str, arch: str) -> tuple[bool, str]:
    """Compiles `source` to a cubin with ptxas verbose output; (success, program log)."""
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"pagedserve_kernels.cu", 0, None, None)
    if rc != 0:
        return False, f"nvrtcCreateProgram failed with {rc}"
    options = [f"-arch={arch}".encode(), *(o.encode() for o in COMPILE_OPTIONS), b"-Xptxas", b"-v"]
    rc = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(max(1, size.value))
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc == 0, log.value.decode(errors="replace")


def dynamic_smem(name: str) -> int:
    head_dim = int(name.rsplit("_d", 1)[1]) if re.search(r"_d\d+$", name) else 0
    if name.startswith("paged_decode_"):
        return decode_smem_bytes(head_dim)
    if name.startswith("paged_prefill_"):
        return prefill_smem_bytes(head_dim)
    return 0


def check_nvcc(nvcc: str, arch: str, failures: list[str]) -> dict[str, dict]:
    """Registers etc. per kernel from nvcc on each file; the NVRTC translation unit must compile too."""
    kernels: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)
        for name in KERNEL_FILES:
            ok, log = compile_nvcc(nvcc, KERNEL_DIR / name, arch, out_dir)
            if not ok:
                failures.append(f"nvcc failed on {name}:\n{log}")
                continue
            for kernel, info in parse_ptxas(log).items():
                info["file"] = name
                kernels[kernel] = info
        module = out_dir / "module.cu"
        module.write_text(kernel_source())
        ok, log = compile_nvcc(nvcc, module, arch, out_dir)
        if not ok:
            failures.append(f"nvcc failed on the NVRTC translation unit (kernel_source()):\n{log}")
    return kernels


def check_nvrtc(lib: ctypes.CDLL, arch: str, failures: list[str]) -> dict[str, dict]:
    """Registers etc. per kernel from NVRTC on the unit CuPy compiles (ptxas reports into the program log)."""
    ok, log = compile_nvrtc(lib, kernel_source(), arch)
    if not ok:
        failures.append(f"NVRTC failed on kernel_source():\n{log}")
        return {}
    messages = [line for line in log.splitlines() if line.strip() and not line.startswith("ptxas")]
    if messages:
        print("NVRTC messages:\n" + "\n".join(messages))
    return parse_ptxas(log)


def judge(compiler: str, kernels: dict[str, dict], expected: list[str], failures: list[str]) -> None:
    """Adds a failure for every kernel missing from `compiler`'s output, spilling, or (if hot) with a stack frame."""
    for name in expected:
        info = kernels.get(name)
        if info is None:
            failures.append(f"{compiler}: kernel {name} missing from the ptxas output")
            continue
        info["dynamic_smem"] = dynamic_smem(name)
        if info["spill_stores"] or info["spill_loads"]:
            failures.append(f"{compiler}: {name} spills ({info['spill_stores']} B stored, {info['spill_loads']} B loaded)")
        if info["stack"] and not name.startswith(COLD_PREFIXES):
            failures.append(f"{compiler}: {name} has a {info['stack']}-byte stack frame")


def print_table(tables: dict[str, dict[str, dict]], expected: list[str]) -> None:
    compilers = list(tables)
    header = f"{'kernel':34} " + " ".join(f"{c + ' regs':>10}" for c in compilers) + \
        f" {'smem':>6} {'dyn smem':>9} {'spill st':>9} {'spill ld':>9} {'stack':>6}"
    print(header)
    print("-" * len(header))
    for name in expected:
        infos = [tables[c][name] for c in compilers if name in tables[c]]
        if not infos:
            continue
        worst = {key: max(info[key] for info in infos) for key in ("smem", "spill_stores", "spill_loads", "stack")}
        regs = " ".join(f"{tables[c][name]['registers'] if name in tables[c] else '-':>10}" for c in compilers)
        flag = "  <- spills" if worst["spill_stores"] or worst["spill_loads"] else ""
        if worst["stack"]:
            flag += "  (stack frame, cold kernel)" if name.startswith(COLD_PREFIXES) else "  <- stack frame"
        print(f"{name:34} {regs} {worst['smem']:>6} {dynamic_smem(name):>9} {worst['spill_stores']:>9} "
              f"{worst['spill_loads']:>9} {worst['stack']:>6}{flag}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--nvcc", default=None)
    parser.add_argument("--json", default=None, help="also write the verdict and the tables as JSON here")
    args = parser.parse_args(argv)

    nvcc = find_nvcc(args.nvcc)
    nvrtc = find_nvrtc()
    expected = kernel_names()
    failures: list[str] = []
    tables: dict[str, dict[str, dict]] = {}
    if nvcc is not None:
        tables["nvcc"] = check_nvcc(nvcc, args.arch, failures)
    if nvrtc is not None:
        tables["nvrtc"] = check_nvrtc(nvrtc[0], args.arch, failures)
    compilers = {"nvcc": nvcc, "nvrtc": nvrtc[1] if nvrtc is not None else None}
    print(f"kernels-check, arch {args.arch}: nvcc {nvcc or 'not found'}; NVRTC "
          f"{nvrtc[1] if nvrtc is not None else 'not found'}")

    if not tables:
        status = "unchecked"
        failures.append("neither nvcc nor libnvrtc found: nothing was compiled (set NVCC or NVRTC_LIBRARY)")
    else:
        if not any(f.startswith("nvcc failed") for f in failures) and "nvcc" in tables:
            judge("nvcc", tables["nvcc"], expected, failures)
        if "nvrtc" in tables and tables["nvrtc"]:
            judge("nvrtc", tables["nvrtc"], expected, failures)
        status = "failed" if failures else "passed"
        print_table(tables, expected)

    if args.json:
        Path(args.json).write_text(json.dumps({"status": status, "arch": args.arch, "compilers": compilers,
                                               "kernels": tables, "failures": failures}, indent=2) + "\n")
    if status == "passed":
        print(f"\nkernels-check passed ({' and '.join(tables)}): {len(expected)} kernels, no spills, "
              "no stack frames in hot kernels")
        return 0
    print(f"\nkernels-check {status.upper()}:")
    for failure in failures:
        print(f"  {failure}")
    return 2 if status == "unchecked" else 1


if __name__ == "__main__":
    sys.exit(main())
