"""`python3 -m pip install --no-build-isolation .` from the repository root: builds the PyTorch
package of bindings/torch (see bindings/torch/setup.py, which does the work)."""
import os
import runpy

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "bindings", "torch", "setup.py"),
               run_name="__main__")
