"""Prepare, on this machine, what `scripts/device_check.sh` needs on the GPU machine: `.device/`.

The GPU machine has PyTorch, transformers and pytest but nothing can be fetched there, and what travels is
capped at 64 MiB. So this writes:
- `.device/whl/`: cp312 manylinux wheels of tokenloom's dependencies that image lacks (~6 MB), at the
  versions installed in this .venv;
- `.device/smollm2-shape/`: the embedded model's config, tokenizer and chat template without its weights
  (the 94 MB GGUF does not fit the cap); the device script fills it with random weights of the same shape,
  which is all a speed benchmark needs. Correctness on the GPU is checked against transformers on tiny
  random models (tests/gpu), where float32 greedy output is token-identical.

Usage: .venv/bin/python scripts/device_prepare.py [--flashinfer VERSION]
(FlashInfer's wheel is 62 MB at 0.7.2: it only fits when the rest is small; the script says what it carried.)
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, ".device")
CARRY_LIMIT = 64 * 2 ** 20
# Runtime dependencies missing from the device image (its package list: the device tool's KINDS.md).
MISSING_THERE = ["msgspec", "pyzmq", "gguf", "fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core",
                 "annotated-types", "typing-inspection", "xgrammar", "prometheus-fastapi-instrumentator",
                 "fastapi-offline"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]


def download(spec: str, dest: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", "-d", dest, spec]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd, check=True)


def write_model_shape(dest: str) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from tokenloom.model.model_path import embedded_model_path
    folder, name = os.path.split(embedded_model_path())
    AutoConfig.from_pretrained(folder, gguf_file=name).save_pretrained(dest)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(dest)


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flashinfer", default=None, help="also carry flashinfer-python==VERSION")
    args = parser.parse_args()
    shutil.rmtree(OUT, ignore_errors=True)
    wheels = os.path.join(OUT, "whl")
    os.makedirs(wheels)
    for name in MISSING_THERE:
        download(f"{name}=={importlib.metadata.version(name)}", wheels)
    if args.flashinfer:
        download(f"flashinfer-python=={args.flashinfer}", wheels)
    write_model_shape(os.path.join(OUT, "smollm2-shape"))
    size = tree_bytes(OUT)
    print(f"{OUT}: {size / 2 ** 20:.1f} MiB ({len(os.listdir(wheels))} wheels)")
    if size > CARRY_LIMIT // 2:
        print("warning: over half the 64 MiB a device call may carry (the working tree counts too)")


if __name__ == "__main__":
    main()
