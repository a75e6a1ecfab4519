"""Solutions to the exercises of notebook 10 (10_write_your_own_ddp.ipynb).

Run them in its kernel after it ran, `%run -i solutions/10_write_your_own_ddp.py`, then run
the check cells again. Each class is a DDP for `--strategy own`.
"""

import torch
import torch.distributed as dist
from torch import nn


class _Replica(nn.Module):
    """What the three share: rank 0's parameters on every rank, the module's forward."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        for p in module.parameters():
            dist.broadcast(p.data, src=0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def _reduce_flat(grads):
    """All-reduce `grads` as one flattened tensor, averaged, copied back."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


# 1. One flattened all-reduce a step: the fixed cost (alpha) paid once.
class FlatDDP(_Replica):
    def finish_gradient_synchronization(self):
        _reduce_flat([p.grad for p in self.module.parameters()])


answer_1 = FlatDDP


# 2. Each gradient's all-reduce started from its hook, while backward goes on.
class OverlappedDDP(_Replica):
    def __init__(self, module):
        super().__init__(module)
        self.handles = []
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._start)

    def _start(self, p):
        self.handles.append((p, dist.all_reduce(p.grad, async_op=True)))

    def finish_gradient_synchronization(self):
        for p, handle in self.handles:
            handle.wait()
            p.grad /= dist.get_world_size()
        self.handles.clear()


answer_2 = OverlappedDDP


# 3. Buckets in backward's order, closed when the next gradient would pass the cap.
class BucketedDDP(_Replica):
    def __init__(self, module, bucket_mb):
        super().__init__(module)
        cap = bucket_mb * 2**20
        self.buckets, held = [[]], 0
        for p in reversed(list(module.parameters())):
            size = p.numel() * p.element_size()
            if self.buckets[-1] and held + size > cap:
                self.buckets.append([])
                held = 0
            self.buckets[-1].append(p)
            held += size

    def finish_gradient_synchronization(self):
        for bucket in self.buckets:
            _reduce_flat([p.grad for p in bucket])


answer_3 = BucketedDDP
