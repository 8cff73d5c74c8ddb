"""The GPU check's first step, about ten seconds: is the CUDA path alive at all?

Prints the versions (torch, CUDA, CuPy, device), compiles the kernels with CuPy (this also fills CuPy's
on-disk cache for the steps after it), launches one split-K decode step (bf16, 14 / 2 heads x 64, four
sequences) and compares it with the float64 torch reference. The verdict is one line starting with
"smoke:", and RESULTS_DIR/smoke.json holds it with a status. Exit 1 on any failure (the later steps run
anyway: they say more). --dry-run checks the imports only and needs no CUDA.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def versions() -> dict:
    import torch

    try:
        import cupy

        cupy_version = cupy.__version__
    except Exception as exc:  # ImportError, or a CuPy build that does not match the driver
        cupy_version = f"not importable ({type(exc).__name__}: {exc})"
    return {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cupy": cupy_version,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"}


def run_decode() -> dict:
    """One decode forward through the CuPy kernels against the float64 reference; raises on a mismatch."""
    import torch

    from executor_svc.attention.cupy_backend import CupyPagedAttention, load_kernels
    from tests.support.attention_reference import PagedProblem

    device = torch.device("cuda")
    started = time.monotonic()
    load_kernels(device)
    compile_s = time.monotonic() - started
    problem = PagedProblem(num_heads=14, num_kv_heads=2, head_dim=64, block_size=16, query_lens=[1] * 4,
                           cached_lens=[2000, 700, 33, 1], num_prefills=0, dtype=torch.bfloat16, device=device)
    backend = CupyPagedAttention(14, 2, 64, problem.scale)
    meta = backend.build_metadata(problem.layout(), device)
    out = backend.forward(problem.query, problem.key, problem.value, problem.key_cache, problem.value_cache, meta)
    torch.cuda.synchronize()
    expected, _, _ = problem.expected()
    got = out.view(expected.shape).double().cpu()
    rel = ((got - expected).norm() / expected.norm()).item()
    if not rel < 1e-2:  # NaN fails too
        raise AssertionError(f"decode output off the reference: relative error {rel:.3e}")
    return {"compile_s": round(compile_s, 2), "partitions": meta.decode_partitions, "relative_error": rel}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="check the imports only (no CUDA needed)")
    args = parser.parse_args(argv)
    results_dir = Path(os.environ.get("RESULTS_DIR") or ROOT / "bench" / "results")
    results_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    report: dict = {}
    try:
        report["versions"] = versions()
        print("versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), flush=True)
        if args.dry_run:
            import executor_svc.attention.cupy_backend  # noqa: F401
            import tests.support.attention_reference  # noqa: F401

            report["status"] = "dry-run"
            line = "smoke: dry run, imports fine, nothing launched"
        elif report["versions"]["device"] == "no CUDA device":
            report["status"] = "no CUDA device"
            line = "smoke: FAILED, torch sees no CUDA device"
        else:
            report.update(run_decode())
            report["status"] = "passed"
            line = (f"smoke: ok, kernels compiled in {report['compile_s']:.1f} s, split-K decode "
                    f"({report['partitions']} partitions) within {report['relative_error']:.1e} of the reference")
    except Exception as exc:
        report["status"] = "failed"
        report["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        line = f"smoke: FAILED, {report['error']}"
    report["seconds"] = round(time.monotonic() - started, 2)
    (results_dir / "smoke.json").write_text(json.dumps(report, indent=2) + "\n")
    print(line, flush=True)
    return 0 if report["status"] in ("passed", "dry-run") else 1


if __name__ == "__main__":
    sys.exit(main())
