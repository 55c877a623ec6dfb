// The extension module moe_engine._C: importing it registers every TORCH_LIBRARY operator of the
// other files (torch.ops.moe_engine.*); it exposes no Python functions of its own.
#include <Python.h>

static struct PyModuleDef moe_engine_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&moe_engine_module); }
