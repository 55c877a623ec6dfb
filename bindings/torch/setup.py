"""python3 -m pip install --no-build-isolation ./bindings/torch   (needs PyTorch with CUDA and nvcc)

Builds the moe-engine C++/CUDA libraries with the project's CMake (or reuses a build folder given
in MOE_CMAKE_BUILD_DIR), then the torch extension moe_engine._C that registers the TORCH_LIBRARY
operators on top of them."""
import os
import subprocess

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BUILD = os.environ.get("MOE_CMAKE_BUILD_DIR", os.path.join(ROOT, "build-torch"))
# Link order: each library before the ones it uses.
LIBS = ["moe_layer", "moe_router", "moe_gemm", "moe_kernels", "moe_device", "moe_checkpoint", "moe_reference",
        "moe_core"]


def build_libraries():
    if not os.path.exists(os.path.join(ROOT, ".deps", "cutlass", "include", "cutlass", "cutlass.h")):
        subprocess.check_call(["bash", os.path.join(ROOT, "scripts", "setup.sh")])
    subprocess.check_call(["cmake", "-S", ROOT, "-B", BUILD, "-DCMAKE_BUILD_TYPE=Release",
                           "-DMOE_BUILD_TESTS=OFF", "-DMOE_BUILD_BENCH=OFF", "-DMOE_BUILD_TOOLS=OFF"])
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
    packages=["moe_engine"],
    ext_modules=[
        CUDAExtension(
            name="moe_engine._C",
            sources=[os.path.join("csrc", f) for f in ("mlp_ops.cpp", "experts_ops.cpp", "dispatch_ops.cpp",
                                                       "gemm_ops.cpp", "router_ops.cpp", "module.cpp")],
            include_dirs=[HERE, os.path.join(ROOT, "include"), os.path.join(ROOT, "src")],
            extra_compile_args={"cxx": ["-O2", "-std=c++17"]},
        )
    ],
    cmdclass={"build_ext": BuildWithLibraries},
    python_requires=">=3.9",
)
