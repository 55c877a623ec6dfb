"""Builds the PyTorch package moe_engine (needs PyTorch with CUDA, nvcc and CMake >= 3.25):

    python3 -m pip install --no-build-isolation ./bindings/torch      # from the repository root
    python3 -m pip install --no-build-isolation .                     # same, through ../../setup.py

`--no-build-isolation` builds against the torch already installed (the extension must match its
ABI exactly; an isolated build would fetch another torch). The build runs the project's CMake for
the C++/CUDA libraries the extension needs (in MOE_CMAKE_BUILD_DIR, default <root>/build-torch;
reused when it is already built), then compiles the extension moe_engine._C that registers the
torch.ops.moe_engine operators on top of them. With MOE_LIBRARIES_DIR set to a folder that holds
those static libraries already (built by the project's CMake with the same options, e.g. copied from
its build/src), the CMake step is skipped and they are linked as they are: the extension itself
includes only the public headers of include/moe.

This file also serves the repository root's setup.py, which runs it with the root as the working
directory: every path handed to setuptools is relative to the working directory."""
import os
import subprocess

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PKG = os.path.relpath(HERE)  # "." when run here, "bindings/torch" from the root
BUILD = os.environ.get("MOE_CMAKE_BUILD_DIR", os.path.join(ROOT, "build-torch"))

# The static libraries the extension links, each before the ones it uses (a new library of
# src/CMakeLists.txt that the layer needs goes here, in dependency order).
LIBS = ["moe_layer", "moe_router", "moe_gemm", "moe_fused", "moe_quant", "moe_kernels", "moe_device", "moe_core"]

# Only the libraries: no tests, benchmarks, tool or checkpoint library, so no JSON, CLI11,
# GoogleTest or zlib is needed.
CMAKE_OPTIONS = ["-DCMAKE_BUILD_TYPE=Release", "-DMOE_BUILD_TESTS=OFF", "-DMOE_BUILD_BENCH=OFF",
                 "-DMOE_BUILD_TOOLS=OFF", "-DMOE_BUILD_CHECKPOINT=OFF"]


def build_libraries():
    prebuilt = os.environ.get("MOE_LIBRARIES_DIR")
    if prebuilt:
        paths = [os.path.join(prebuilt, f"lib{name}.a") for name in LIBS]
        missing = [p for p in paths if not os.path.exists(p)]
        if missing:
            raise RuntimeError(f"MOE_LIBRARIES_DIR={prebuilt}: missing {', '.join(missing)}")
        return paths
    if not os.path.exists(os.path.join(ROOT, ".deps", "cutlass", "include", "cutlass", "cutlass.h")):
        subprocess.check_call(["bash", os.path.join(ROOT, "scripts", "setup.sh")])
    subprocess.check_call(["cmake", "-S", ROOT, "-B", BUILD, *CMAKE_OPTIONS])
    subprocess.check_call(["cmake", "--build", BUILD, "-j", str(os.cpu_count() or 2), "--target", *LIBS])
    return [os.path.join(BUILD, "src", f"lib{name}.a") for name in LIBS]


class BuildWithLibraries(BuildExtension):
    def run(self):
        objects = build_libraries()
        for ext in self.extensions:
            ext.extra_objects = objects
        super().run()


setup(
    name="moe-engine",
    version="0.1.0",
    description="CUDA-graph-safe fused MoE expert layer for Hopper (PyTorch binding of moe-engine)",
    long_description=open(os.path.join(HERE, "README.md")).read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=["moe_engine", "moe_engine.integrations"],
    package_dir={"moe_engine": os.path.join(PKG, "moe_engine"),
                 "moe_engine.integrations": os.path.join(PKG, "moe_engine", "integrations")},
    ext_modules=[
        CUDAExtension(
            name="moe_engine._C",
            sources=[os.path.join(PKG, "csrc", f)
                     for f in ("mlp_ops.cpp", "experts_ops.cpp", "dispatch_ops.cpp", "gemm_ops.cpp", "router_ops.cpp",
                               "module.cpp")],
            include_dirs=[HERE, os.path.join(ROOT, "include"), os.path.join(ROOT, "src")],
            extra_compile_args={"cxx": ["-O2", "-std=c++17"]},
        )
    ],
    cmdclass={"build_ext": BuildWithLibraries},
    # Setuptools' own build and egg-info folders stay in bindings/torch from either directory (the
    # root's build/ belongs to CMake).
    options={"build": {"build_base": os.path.join(PKG, "build")}, "egg_info": {"egg_base": PKG}},
    python_requires=">=3.9",
    install_requires=["torch"],
)
