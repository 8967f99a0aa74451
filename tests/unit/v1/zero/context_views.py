"""A frozen module whose autograd Function keeps a view of the gathered weight on its ctx, outside
save_for_backward, as bitsandbytes' 4-bit matmul does (ctx.tensors = (None, weight.t())); the
views each call kept, weakly, for the tests that count their bytes."""
import weakref

import torch
import torch.nn as nn

# Weak references to the views the Function kept; a test clears it before the run it measures.
KEPT_VIEWS = []


class KeepsWeightViewOnContext(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight):
        ctx.weight_t = weight.t()  # a view of the gathered storage, as bitsandbytes keeps B
        KEPT_VIEWS.append(weakref.ref(ctx.weight_t))
        return x @ ctx.weight_t

    @staticmethod
    def backward(ctx, grad):
        return grad @ ctx.weight_t.t(), None


class ViewLinear(nn.Module):

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) / dim**0.5, requires_grad=False)

    def forward(self, x):
        return KeepsWeightViewOnContext.apply(x, self.weight)


def kept_bytes() -> int:
    """Bytes of the distinct storages under the live kept views."""
    storages = {}
    for ref in KEPT_VIEWS:
        view = ref()
        if view is not None:
            storage = view.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
