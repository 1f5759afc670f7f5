"""``replayssm info``: versions, devices and available backends."""

from __future__ import annotations

import platform


def add_arguments(parser) -> None:
    pass


def main(args) -> int:
    import torch

    from ..version import __version__
    from ..ops.dispatch import triton_available
    from ..strategies import STRATEGIES

    print(f"replayssm {__version__}  python {platform.python_version()}  torch {torch.__version__}")
    if triton_available():
        import triton

        print(f"triton {triton.__version__}")
    else:
        print("triton: not installed (reference backend only)")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            print(f"cuda:{i} {torch.cuda.get_device_name(i)}")
    else:
        print("cuda: none (reference backend on the CPU; Triton kernels need TRITON_INTERPRET=1 here)")
    print("strategies:", ", ".join(STRATEGIES))
    return 0
