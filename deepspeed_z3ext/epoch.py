"""The tree epoch: a counter that moves whenever a module tree or its parameters may have changed.

[Note: tree epoch] z3ext caches what it derives from a model's module tree: each module's fetch unit
(its own and its external parameters, state.py), each fetch group's union of its members' units
([Note: fetch groups]), and the list of the tree's parameter dicts that DeepSpeed flags at each forward
([Note: forward flags] in external.py). Checking such a cache against the tree at each use was
per-module host work in every forward: seven key tuples per block fetch of a GPT, and DeepSpeed's
forward prologue and epilogue walking every module (on the CPU VM, 1.1M and 2.0M of the 36M
instructions of a 16-layer GPT's tiny forward, bench/NOTES.md v21). A cache entry instead records the
epoch it was made or checked at, and is used as is while the epoch has not moved. It moves when
- a module is registered on a module of a z3ext tree (one with a `ds_id`): attribute assignment,
  `add_module`, `ModuleList.append` (torch's global module-registration hook, installed with the first
  z3ext engine). Registrations on other modules do not move it: a module outside the tree reaches it only
  by a registration on a tree module, which moves it then. HF Llama's forward slices its layers
  (`self.layers[:n]`, a new ModuleList registering every layer): that moved the epoch in every forward;
- a ZeROOrderedDict (a ZeRO module's `_parameters`) gains, replaces or loses a parameter: seams.py
  replaces its `__setitem__` and `__delitem__`, through which nn.Module's `register_parameter`,
  `__setattr__`, `__delattr__` and `_apply` and OrderedDict's `update`, `pop` and `popitem` reach it;
- z3ext registers or unregisters an external parameter, claims one it discovered, or sees a module
  with more external parameters than its cached unit was made with (external.py, hooks.py).
Not seen: a dict replaced wholesale (`module._parameters = {...}`) or written through
`OrderedDict.__setitem__(d, ...)`; a user's `register_external_parameter` is seen at the parameter's
first use in a forward. Such a change reaches the caches at the next move of the epoch.
"""


class TreeEpoch:
    __slots__ = ("value", )

    def __init__(self):
        self.value = 0

    def advance(self, *_hook_args):
        """Moves the epoch."""
        self.value += 1

    def registered(self, parent, _name, _module):
        """torch's module-registration hook (returns None: the module is kept): moves the epoch when the
        parent belongs to a z3ext tree."""
        if "ds_id" in parent.__dict__:
            self.value += 1


TREE = TreeEpoch()
_torch_hook = None


def watch_module_registrations():
    """Installs torch's global module-registration hook that moves the epoch (once per process)."""
    global _torch_hook
    if _torch_hook is None:
        from torch.nn.modules.module import register_module_module_registration_hook
        _torch_hook = register_module_module_registration_hook(TREE.registered)


def setitem(stock):
    """`ZeROOrderedDict.__setitem__` (seams.py): a parameter set, added or replaced moves the epoch."""
    def __setitem__(self, key, value):
        TREE.advance()
        stock(self, key, value)

    return __setitem__


def delitem(stock):
    """`ZeROOrderedDict.__delitem__` (seams.py): a parameter removed moves the epoch."""
    def __delitem__(self, key):
        TREE.advance()
        stock(self, key)

    return __delitem__
