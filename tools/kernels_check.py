"""Compiles the CUDA kernels for sm_90 and checks their resource use; no GPU needed.

1. nvcc -arch=sm_90 -cubin -std=c++17 -Xptxas -v on every executor_svc/kernels/*.cu, and on the single
   translation unit the CuPy backend hands to NVRTC (cupy_backend.kernel_source());
2. the same translation unit through NVRTC itself when libnvrtc can be found (CuPy compiles with it);
3. a table per kernel: registers, static and dynamic shared memory, spill stores / loads, stack frame.

Exit status 1 on a compile error, a kernel missing from the output, any spill, or a non-zero stack frame in a
hot kernel (every kernel except the float32 row-wise path used for tests). Exit 0 with a message when nvcc
is absent. Usage: python tools/kernels_check.py [--arch sm_90] [--nvcc PATH] [--json FILE]
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
    for candidate in (explicit, os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
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


def find_nvrtc() -> ctypes.CDLL | None:
    """libnvrtc from $NVRTC_LIBRARY, the nvidia-cuda-nvrtc wheel, CuPy's environment or the system."""
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
    for path in paths:
        if not path or "builtins" in path or ".alt." in path:
            continue
        try:
            folder = os.path.dirname(path)
            # libnvrtc loads libnvrtc-builtins by name at compile time; make the one beside it resolvable.
            for builtins in sorted(glob.glob(os.path.join(folder, "libnvrtc-builtins.so*"))):
                if ".alt." not in builtins:
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def compile_nvrtc(lib: ctypes.CDLL, source: str, arch: str) -> tuple[bool, str]:
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"pagedserve_kernels.cu", 0, None, None)
    if rc != 0:
        return False, f"nvrtcCreateProgram failed with {rc}"
    options = [f"-arch={arch}".encode(), *(o.encode() for o in COMPILE_OPTIONS)]
    rc = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(max(1, size.value))
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc == 0, log.value.decode(errors="replace")


def dynamic_smem(name: str) -> int:
    head_dim = int(name.rsplit("_d", 1)[1]) if re.search(r"_d\d+$", name) else 0
    if name.startswith("paged_decode_") and "reduce" not in name:
        return decode_smem_bytes(head_dim)
    if name.startswith("paged_prefill_"):
        return prefill_smem_bytes(head_dim)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--nvcc", default=None)
    parser.add_argument("--json", default=None, help="also write the table as JSON here")
    args = parser.parse_args(argv)

    nvcc = find_nvcc(args.nvcc)
    if nvcc is None:
        print("kernels-check: skipped, nvcc not found (set NVCC or put it on PATH)")
        return 0

    failures: list[str] = []
    kernels: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)
        for name in KERNEL_FILES:
            ok, log = compile_nvcc(nvcc, KERNEL_DIR / name, args.arch, out_dir)
            if not ok:
                failures.append(f"nvcc failed on {name}:\n{log}")
                continue
            for kernel, info in parse_ptxas(log).items():
                info["file"] = name
                kernels[kernel] = info
        module = out_dir / "module.cu"
        module.write_text(kernel_source())
        ok, log = compile_nvcc(nvcc, module, args.arch, out_dir)
        if not ok:
            failures.append(f"nvcc failed on the NVRTC translation unit (kernel_source()):\n{log}")

    lib = find_nvrtc()
    if lib is None:
        nvrtc_status = "skipped (libnvrtc not found)"
    else:
        ok, log = compile_nvrtc(lib, kernel_source(), args.arch)
        nvrtc_status = "ok" if ok and not log.strip() else ("ok, with messages" if ok else "FAILED")
        if not ok:
            failures.append(f"NVRTC failed on kernel_source():\n{log}")
        elif log.strip():
            print(f"NVRTC messages:\n{log}")

    expected = kernel_names()
    for name in expected:
        if name not in kernels and not any(f.startswith("nvcc failed") for f in failures):
            failures.append(f"kernel {name} missing from the ptxas output")

    header = f"{'kernel':34} {'regs':>5} {'smem':>6} {'dyn smem':>9} {'spill st':>9} {'spill ld':>9} {'stack':>6}"
    print(f"kernels-check: {nvcc}, arch {args.arch}; NVRTC: {nvrtc_status}")
    print(header)
    print("-" * len(header))
    for name in expected:
        info = kernels.get(name)
        if info is None:
            continue
        info["dynamic_smem"] = dynamic_smem(name)
        cold = name.startswith(COLD_PREFIXES)
        flag = ""
        if info["spill_stores"] or info["spill_loads"]:
            failures.append(f"{name} spills ({info['spill_stores']} B stored, {info['spill_loads']} B loaded)")
            flag = "  <- spills"
        if info["stack"]:
            if cold:
                flag += "  (stack frame, cold kernel)"
            else:
                failures.append(f"{name} has a {info['stack']}-byte stack frame")
                flag += "  <- stack frame"
        print(f"{name:34} {info['registers']:>5} {info['smem']:>6} {info['dynamic_smem']:>9} "
              f"{info['spill_stores']:>9} {info['spill_loads']:>9} {info['stack']:>6}{flag}")

    if args.json:
        Path(args.json).write_text(json.dumps({"arch": args.arch, "nvrtc": nvrtc_status, "kernels": kernels,
                                               "failures": failures}, indent=2) + "\n")
    if failures:
        print("\nkernels-check FAILED:")
        for failure in failures:
            print(f"  {failure}")
        return 1
    print(f"\nkernels-check passed: {len(expected)} kernels, no spills, no stack frames in hot kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
