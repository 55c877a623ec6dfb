"""Test set-up: run as `cd bindings/torch && python3 -m pytest tests` after installing the package.

`python3 -m pytest` puts the working directory on sys.path, and bindings/torch holds the source
folder moe_engine/, which after a normal (non-editable) install has no compiled extension _C: it
would shadow the installed package ("cannot import name '_C'"). So that entry is dropped unless
the source folder holds a built extension (an in-place build). The tests folder itself stays on
sys.path (pytest's default import mode), for `from reference import ...`."""
import glob
import os
import sys

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bindings/torch


def _holds_built_extension(root):
    return bool(glob.glob(os.path.join(root, "moe_engine", "_C*.so")) +
                glob.glob(os.path.join(root, "moe_engine", "_C*.pyd")))


if not _holds_built_extension(_PACKAGE_ROOT):
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _PACKAGE_ROOT]

import torch  # noqa: E402

# Without a GPU only the tests of the plain-Python helpers and of the constructors' argument checks
# run (no operator touches a device); every other file needs one and is not collected.
_NEEDS_NO_GPU = {"test_argument_names.py", "test_checkpoint_helpers.py", "test_gate_and_input.py", "test_handles.py",
                 "test_hf_gates.py"}
if not torch.cuda.is_available():
    collect_ignore = [os.path.basename(p) for p in glob.glob(os.path.join(os.path.dirname(__file__), "test_*.py"))
                      if os.path.basename(p) not in _NEEDS_NO_GPU]


def pytest_report_header(config):
    if not torch.cuda.is_available():
        return f"no CUDA GPU: only {', '.join(sorted(_NEEDS_NO_GPU))} runs"
    return None
