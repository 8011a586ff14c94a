"""Print what CMake needs to know about the installed torch, as `set(...)` lines.

Called by CMakeLists.txt at configure time. We read these facts from the torch that will import
the extension instead of using TorchConfig.cmake, whose CUDA detection is slow and fragile with
new toolkits.
"""

import os

import torch

root = os.path.dirname(torch.__file__)
facts = {
    "QOPS_TORCH_VERSION": torch.__version__,
    "QOPS_TORCH_INCLUDE_DIRS": ";".join(
        [os.path.join(root, "include"), os.path.join(root, "include", "torch", "csrc", "api", "include")]
    ),
    "QOPS_TORCH_LIB_DIR": os.path.join(root, "lib"),
    "QOPS_TORCH_CXX11_ABI": str(int(torch._C._GLIBCXX_USE_CXX11_ABI)),
    "QOPS_TORCH_CUDA_VERSION": torch.version.cuda or "",
}
for k, v in facts.items():
    print(f'set({k} "{v}")')
