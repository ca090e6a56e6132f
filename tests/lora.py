"""A LoRA-like adapter model (frozen base Linear, trainable A/B) whose forward touches the adapter's
parameters outside their own modules, and its training loops: DeepSpeed (z3ext or stock) and a plain
PyTorch reference without activation checkpointing. Used by tests/test_trace.py."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

D_IN, D, R = 8, 16, 4
LR, WD = 1e-2, 0.01


class LoraLinear(nn.Module):

    def __init__(self, d, r, access):
        super().__init__()
        self.access = access  # "dtype": metadata read only; "numeric": also uses weights outside their modules
        self.base = nn.Linear(d, d)
        self.base.weight.requires_grad_(False)
        self.base.bias.requires_grad_(False)
        self.lora_A = nn.Linear(d, r, bias=False)
        self.lora_B = nn.Linear(r, d, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.1)  # non-zero so A gets gradients from step 1

    def forward(self, x):
        # As PEFT does: cast the input to the adapter's dtype (a read of lora_A.weight outside lora_A).
        x = x.to(self.lora_A.weight.dtype)
        extra = 0
        if self.access == "numeric":
            # Numeric uses outside the owning modules, before those modules run (during checkpoint
            # recomputation these must be the full tensors).
            extra = 0.01 * F.linear(x, self.base.weight).tanh() + 0.1 * F.linear(x, self.lora_A.weight).sum(-1, True)
        y = self.base(x)
        h = self.lora_A(x)
        return y + self.lora_B(torch.tanh(h)) + extra


class LoraNet(nn.Module):

    def __init__(self, layers=2, ckpt=None, access="numeric"):
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.layers = nn.ModuleList(LoraLinear(D, R, access) for _ in range(layers))
        self.out = nn.Linear(D, 1)
        self.out.weight.requires_grad_(False)
        self.out.bias.requires_grad_(False)
        self.ckpt = ckpt  # None | "reentrant" | "non-reentrant"

    def forward(self, x, y):
        h = self.inp(x)
        for layer in self.layers:
            if self.ckpt is None:
                h = layer(h)
            else:
                h = checkpoint(layer, h, use_reentrant=self.ckpt == "reentrant")
        return F.mse_loss(self.out(h).squeeze(-1), y)


def data(micro, rank, bsz=4):
    g = torch.Generator().manual_seed(7919 * micro + rank)
    return torch.randn(bsz, D_IN, generator=g), torch.randn(bsz, generator=g)


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def ds_config(persistence, bucket, ga, z3ext=True):
    zero = {"stage": 3, "stage3_param_persistence_threshold": persistence}
    if bucket is not None:
        zero["stage3_prefetch_bucket_size"] = bucket
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": ga,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "torch_adam": True}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    if z3ext:
        cfg["z3ext"] = True
    return cfg


def reference(seed, world, ga, steps, access):
    """Plain PyTorch, one process, no checkpointing: every rank's micro-batches, gradients averaged
    over ranks and micro-steps as DeepSpeed does. Returns (losses per (micro, rank), state per step)."""
    torch.manual_seed(seed)
    model = LoraNet(access=access)
    opt = torch.optim.AdamW(trainable(model), lr=LR, weight_decay=WD)
    losses, states = [], []
    for step in range(steps):
        for m in range(ga):
            micro = step * ga + m
            row = []
            for r in range(world):
                loss = model(*data(micro, r))
                (loss / (ga * world)).backward()
                row.append(loss.item())
            losses.append(row)
        opt.step()
        opt.zero_grad()
        states.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, states
