import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("moe_engine tests need a CUDA GPU", allow_module_level=True)
