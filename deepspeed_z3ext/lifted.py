"""LiftedHooks: the module hooks a generation step does not need, taken out while the resident set lasts.

[Note: lifted hooks] On the resident fast path ([Note: resident fast path] in resident_set.py) every module's
two hooks run and do nothing but keep DeepSpeed's module stack: per module and token two Python calls through
torch's hook dispatch, where a module without hooks is one `forward(*args)` call. That was most of what a
generated token cost beyond the unsharded model. So when a fast-path forward starts, the modules the set
covers lose their two hooks (the root keeps its own, and whatever hooks other code registered stay where they
were); they get them back, in their place among the others, when the fast path ends: a module outside the set
runs (its hooks are still there and end it), a forward that is not a generation step starts (the root's hook
sees it), residency ends (the step, `engine.backward`, `train()`, `release_resident`). Nothing a lifted hook
would have done is missed: in a fast-path forward every parameter of a covered module is gathered, so
DeepSpeed's module stack is read by nothing (its `ZeROOrderedDict` reads it only for a parameter not
available). DeepSpeed removing the hooks (to register them anew, or at destroy) drops what is lifted.
"""
from collections import OrderedDict


class LiftedHooks:

    def __init__(self):
        self._hooks = {}   # id(module) -> (module, pre-hook id, post-hook id): the lift-able ones
        self._lifted = {}  # id(module) -> (module, its three hook dicts' items before the lift)
        self._ids = None   # the module ids lifted for

    def add(self, module, pre_handle, post_handle):
        """A module's two hooks become lift-able; returns their handles, which forget the module when removed
        (DeepSpeed removes them to register anew, or at destroy: a lifted hook must not come back then)."""
        key = id(module)
        self._hooks[key] = (module, pre_handle.id, post_handle.id)
        return [_Handle(self, key, pre_handle), _Handle(self, key, post_handle)]

    def forget(self, key):
        self._hooks.pop(key, None)
        self._lifted.pop(key, None)

    @property
    def active(self) -> bool:
        return bool(self._lifted)

    def lift(self, ids):
        """The two hooks of every module in `ids` (module ids) come out of its hook dicts."""
        if ids is self._ids:
            return  # lifted for this set already (the next token)
        self._ids = ids
        for key in ids:
            entry = self._hooks.get(key)
            if entry is None or key in self._lifted:
                continue
            m, pre, post = entry
            dicts = (m._forward_pre_hooks, m._forward_hooks, m._forward_hooks_always_called)
            self._lifted[key] = (m, [list(d.items()) for d in dicts])
            m._forward_pre_hooks.pop(pre, None)
            m._forward_hooks.pop(post, None)
            m._forward_hooks_always_called.pop(post, None)

    def restore(self):
        """Every lifted hook back, in its place: hooks registered meanwhile after, hooks removed meanwhile gone."""
        lifted, self._lifted, self._ids = self._lifted, {}, None
        for key, (m, before) in lifted.items():
            _, pre, post = self._hooks[key]
            for d, items, ours in zip((m._forward_pre_hooks, m._forward_hooks, m._forward_hooks_always_called),
                                      before, ({pre}, {post}, {post})):
                now = OrderedDict(d)
                restored = OrderedDict((k, v) for k, v in items if k in now or k in ours)
                restored.update((k, v) for k, v in now.items() if k not in restored)
                d.clear()  # in place: a RemovableHandle holds a weak reference to this very dict
                d.update(restored)



class _Handle:
    """A hook's RemovableHandle that also tells the LiftedHooks (DeepSpeed calls `remove()` on it)."""

    def __init__(self, lifted, key, handle):
        self._lifted, self._key, self._handle = lifted, key, handle
        self.id = handle.id

    def remove(self):
        self._lifted.forget(self._key)
        self._handle.remove()
