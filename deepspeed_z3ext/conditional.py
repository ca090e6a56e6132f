"""Conditional blocks and modules: parts of a model that run on some ranks or steps and not others.

[Note: conditional blocks] In a block with one module per expert (an `nn.ModuleList` or `nn.ModuleDict` of
experts next to a router: DeepSpeed's `deepspeed.moe` layer, Switch / NLLB-MoE, most research MoE code) an
expert runs only where a token was routed to it. Per-module units would then make each rank gather the
experts its own tokens reached: different collectives on different ranks (gloo: "Received data size doesn't
match expected size"; NCCL: a hang), and a reduce-scatter of only the gradients that exist on that rank.
The schedule must follow what every rank does alike, the block ran ([Note: one schedule on every rank] in
schedule.py), so such a block is one unit, decided from the module tree before the first forward: z3ext
marks it a DeepSpeed z3 leaf module (`deepspeed.utils.set_z3_leaf_module`), exactly what a stock user marks
by hand. Its forward gathers all its experts in one collective; its backward's full-module hook (stock's
`reduce_leaf_module_grads`) gives every parameter a gradient, zeros for an expert no token of this rank
reached, so every rank reduces the same parameters. The numbers are those of stock ZeRO-3 with the block
marked by hand (tests/test_conditional.py).

A block is found structurally: a list or dict of at least two experts of one type and equal parameter
shapes, and, within three levels above it and outside it, a router: a 2-D parameter of shape
(experts, d) or (d, experts) where d is a dimension of the experts' parameters (`nn.Linear(d, experts)`, or a
raw matrix either way round), of the module above or of a module at most two below that one and inside no
list or dict of modules (a LoRA adapter of rank r in another stack of layers is no router of r layers), and no
embedding table (a position table of as many rows as a model has layers is no router). The smallest module
holding both is the block (the root too: an MoE layer trained alone), never a module inside a z3 leaf already. The guess is bounded ([Note: a bounded guess]).

[Note: a bounded guess] The structure is a guess, and a wrong one (a plain stack of layers beside a raw
parameter that looks like a router) would gather everything under the holder at once. So a block larger than
a fetch group may be (`z3ext.fetch_group_numel`, default half of `stage3_max_live_parameters`: what z3ext
already gathers at once as a group of modules) is not made a unit, and the log says so; a wrong guess costs at
most what a fetch group costs, never the whole of a model larger than that, and never correctness: gradients do
not depend on units ([Note: fixed gradient layout] in grads.py). Fused experts (one parameter per projection, HF Mixtral / Qwen3-MoE in
transformers 5) need nothing: every rank runs the same modules.

Memory: the block is gathered whole while it runs (and held for backward like any unit), so the live
parameters include all its experts, not only those reached. The log names each block with its elements;
a block over stage3_max_live_parameters is warned about. `"z3ext": {"conditional_blocks": false}` turns the
detection off (blocks marked with `set_z3_leaf_modules` stay leaves).

[Note: conditional modules] A submodule that some ranks run and others skip in a step (a vision tower on
text-only batches, an auxiliary head used on some batches) cannot be found from the tree, and no block
around it but its parent runs on every rank. Named in `"z3ext": {"conditional_modules": [...]}` (a qualified
module name, or a class name for every module of that class), such a module C has no hooks of its own: its
parameters join its parent's unit, gathered when the parent's forward starts on every rank whether C runs or
not, released or held for backward with it (the parent: the nearest module above C that is no ModuleList or
ModuleDict, which never run). Its gradients need nothing declared: z3ext's gradient layout reduces C's
parameters in their fixed place, zeros where C did not run ([Note: fixed gradient layout] in grads.py); on
DeepSpeed's gradient path (offload, qgZ, ...) they get no per-parameter hook and are reduced at the end of each
backward (DeepSpeed's epilogue, which every rank reaches), their gradient or zeros. C's gradient is the sum over
the ranks that ran it, as with a dummy input that adds 0 times C's output to the loss on the others (stock's
way, tests/test_conditional.py). It costs C's
gather in every forward of the parent, and C's memory for that whole forward. C must run inside its
parent's forward (the parent's unit is gathered only then).
"""
from typing import List, NamedTuple, Optional

import torch.nn as nn
from deepspeed.utils import log_dist, logger, set_z3_leaf_module, z3_leaf_module

from deepspeed_z3ext.errors import Z3extConfigError

_LEVELS = 3  # how far above the experts' container a router is looked for


class ConditionalBlock(NamedTuple):
    name: str         # the block's qualified name in the model
    block: nn.Module  # gathered as one unit
    experts: int      # entries of its experts' container
    numel: int        # elements of all its parameters (full sizes)


def _numel(p) -> int:
    return int(getattr(p, "ds_numel", p.numel()))


def _shape(p):
    return tuple(getattr(p, "ds_shape", p.shape))


def _experts(container):
    """The entries of a ModuleList / ModuleDict when they look like experts: two or more, one type, each
    with parameters of the same shapes."""
    if not isinstance(container, (nn.ModuleList, nn.ModuleDict)):
        return None
    entries = list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)
    if len(entries) < 2 or len({type(e) for e in entries}) != 1:
        return None
    shapes = [tuple(_shape(p) for p in e.parameters()) for e in entries]
    if not shapes[0] or any(s != shapes[0] for s in shapes[1:]):
        return None
    return entries


def _router_candidates(holder):
    """The parameters that may be a router of experts below `holder`: its own and those of the modules at most
    two below it outside any list or dict of modules. A router sits beside its experts (`gate`, `gate.wg`,
    `router.classifier`), not inside a stack of layers: a LoRA adapter's (r, d) matrix in a decoder layer is no
    router of the encoder's r layers."""
    out, level = list(holder.parameters(recurse=False)), [holder]
    for _ in range(2):
        level = [c for m in level for c in m.children() if not isinstance(c, (nn.ModuleList, nn.ModuleDict))]
        out.extend(p for c in level for p in c.parameters(recurse=False))
    return out


def _has_router(holder, container, n, dims) -> bool:
    inside = {id(p) for p in container.parameters()}
    inside.update(id(p) for m in holder.modules() if isinstance(m, nn.Embedding) for p in m.parameters())
    for p in _router_candidates(holder):
        if id(p) in inside:
            continue
        shape = _shape(p)
        if len(shape) == 2 and ((shape[0] == n and shape[1] in dims) or (shape[1] == n and shape[0] in dims)):
            return True
    return False


def find(root: nn.Module, max_numel: Optional[int] = None) -> List[ConditionalBlock]:
    """The conditional blocks of `root` ([Note: conditional blocks]), outermost first, none nested; none of
    more than `max_numel` elements ([Note: a bounded guess])."""
    names = {id(m): n for n, m in root.named_modules()}
    parents = {id(c): m for m in root.modules() for c in m.children()}
    found, taken = [], set()
    for container in root.modules():
        entries = _experts(container)
        if entries is None:
            continue
        n = len(entries)
        dims = {d for p in entries[0].parameters() for d in _shape(p)}
        holder, level = parents.get(id(container)), 1
        while holder is not None and level <= _LEVELS and not _has_router(holder, container, n, dims):
            holder, level = parents.get(id(holder)), level + 1
        if holder is None or level > _LEVELS or id(holder) in taken:
            continue
        chain, up = [holder], parents.get(id(holder))
        while up is not None:
            chain.append(up)
            up = parents.get(id(up))
        if any(z3_leaf_module(m) or id(m) in taken for m in chain):
            continue  # marked by hand, or inside a block found already
        if any(z3_leaf_module(m) for m in holder.modules()):
            continue  # a leaf inside: the user chose the unit
        numel = sum(_numel(p) for p in holder.parameters())
        if max_numel is not None and numel > max_numel:
            log_dist(f"z3ext: {names.get(id(holder)) or '<root>'} ({type(holder).__name__}, {numel} elements) looks like a "
                     f"mixture-of-experts block but is larger than a fetch group ({max_numel} elements): not gathered as "
                     "one unit ([Note: a bounded guess]); if its experts run on some ranks only, mark it with "
                     "deepspeed.utils.set_z3_leaf_modules or raise \"z3ext\": {\"fetch_group_numel\"}", ranks=[0])
            continue
        taken.update(id(m) for m in holder.modules())
        found.append(ConditionalBlock(names.get(id(holder)) or "<root>", holder, n, numel))
    return found


def mark(root: nn.Module, max_numel: Optional[int] = None) -> List[ConditionalBlock]:
    """Marks each conditional block of `root` (of at most `max_numel` elements) a z3 leaf module, logs them
    (rank 0), returns them."""
    blocks = find(root, max_numel)
    for b in blocks:
        set_z3_leaf_module(b.block, True)
    if blocks:
        shown = ", ".join(f"{b.name} ({type(b.block).__name__}, {b.experts} experts, {b.numel} elements)"
                          for b in blocks[:3])
        more = f" and {len(blocks) - 3} more" if len(blocks) > 3 else ""
        log_dist(f"z3ext: {len(blocks)} mixture-of-experts block(s) gathered as one unit each, so that every rank "
                 f"gathers the same whatever its routing: {shown}{more} ([Note: conditional blocks]; "
                 f'"z3ext": {{"conditional_blocks": false}} turns this off)', ranks=[0])
    return blocks


def warn_over_budget(blocks, max_live_numel):
    over = [b for b in blocks if b.numel > max_live_numel]
    if over:
        logger.warning(f"z3ext: mixture-of-experts block {over[0].name} ({over[0].numel} elements) is larger than "
                       f"stage3_max_live_parameters ({max_live_numel}); it is gathered whole all the same "
                       "([Note: conditional blocks])")


CONDITIONAL_ATTR = "_z3ext_conditional"            # on a conditional module ([Note: conditional modules])
CHILDREN_ATTR = "_z3ext_conditional_children"      # on its parent: the conditional modules it gathers


def mark_modules(root: nn.Module, entries) -> List[nn.Module]:
    """Marks the modules `entries` names ([Note: conditional modules]); returns their parameters. Raises
    `Z3extConfigError` naming an entry that matches no module, or the root."""
    if not entries:
        return []
    named = list(root.named_modules())
    parents = {id(c): m for m in root.modules() for c in m.children()}
    chosen, seen = [], set()
    for entry in entries:
        hits = [(n, m) for n, m in named if n == entry or type(m).__name__ == entry]
        if not hits:
            import difflib
            near = difflib.get_close_matches(entry, [n for n, _ in named if n] + sorted({type(m).__name__ for _, m in named}),
                                             n=3)
            hint = f"; did you mean {', '.join(repr(x) for x in near)}?" if near else ""
            raise Z3extConfigError(f'"z3ext.conditional_modules": {entry!r} is neither a module name nor a module '
                                   f"class of this model{hint}")
        for n, m in hits:
            if m is root:
                raise Z3extConfigError(f'"z3ext.conditional_modules": {entry!r} is the model itself; name the '
                                       "submodule that some ranks or steps skip")
            if id(m) not in seen:
                seen.add(id(m))
                chosen.append(m)
    ids = {id(m) for m in chosen}
    params = []
    for m in chosen:
        up, inside = parents.get(id(m)), False
        while up is not None:  # inside another conditional module or a z3 leaf: that one is the unit
            if id(up) in ids or z3_leaf_module(up):
                inside = True
            up = parents.get(id(up))
        if inside:
            continue
        setattr(m, CONDITIONAL_ATTR, True)
        parent = parents[id(m)]
        while isinstance(parent, (nn.ModuleList, nn.ModuleDict)) and id(parent) in parents:
            parent = parents[id(parent)]  # a container never runs a forward of its own
        children = parent.__dict__.setdefault(CHILDREN_ATTR, [])
        if all(c is not m for c in children):
            children.append(m)
        params.extend(m.parameters())
    return list({id(p): p for p in params}.values())  # (a model built outside zero.Init has no ds_ids yet)


def conditional_params(module):
    """The parameters of `module`'s conditional children, which its unit gathers ([Note: conditional modules])."""
    children = module.__dict__.get(CHILDREN_ATTR)
    return [p for c in children for p in c.parameters()] if children else []


def is_conditional(module) -> bool:
    return module.__dict__.get(CONDITIONAL_ATTR, False)
