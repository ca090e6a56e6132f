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

[Note: member hooks] Inside an open fetch group ([Note: fetch groups] in groups.py) the owner's forward has
gathered every member's parameters, and with MemberClaims.NONE (the group is released, held or claimed whole)
a member's two hooks do nothing that matters but the input boundary ([Note: input boundary] in hooks.py): they
keep DeepSpeed's module stack and z3ext's running list, and return at once. Yet torch's hook dispatch and the
two calls were most of a small module's host cost beyond its own ops. So while the group is open (from the
owner's fetch to its release, also one that raised; any forward's start closes what an abandoned one left) its
members and the parameter-less modules inside it lose both of z3ext's hooks, and torch calls their forward
directly; in grad mode that forward is, for the time, an instance attribute that adds the input boundary to the
positional inputs and calls the module's own forward (an instance `forward` it had is called and put back): the
pre-forward hook's boundary, without the hook dispatch. Only modules whose hook dicts hold z3ext's hooks alone
are lifted; a module with other hooks keeps z3ext's, as does a module with parameters that is no member (a
branch the recorded forward did not take: it fetches its own unit). What the lifted hooks did is done elsewhere:
- external discovery (external.py) sees the owner as the running module: a member's access of a parameter of
  its group is the group's own; any other parameter is discovered for the owner, as a member's discovery is;
- a member that returns one of its parameters: the parameter is the group's, gathered until the owner's release
  (stock registers it to the enclosing module, whose unit the group is); the owner's own hook sees it returned;
- a no_grad forward that keeps units resident ([Note: generation residency]) counts the lifted modules as run.
Not under a compiled region (Dynamo guards on hook dicts) nor for an engine DeepCompile took over. A grad mode
switched on inside a no_grad owner's forward adds no boundary to its members' inputs. The lift walks the
owner's lift-able modules once per forward (a list kept per group, rebuilt when hooks are added or removed).

[Note: kept lift] Lifting a group's members and putting their hooks back at every open and close was the largest
part of a member's host cost beyond its ops: about 2.2 M instructions of a GPT 32x64 forward's 52.8 M
(bench/NOTES.md v48). So a lift made in grad mode stays when the group closes; only the parameter dicts look up
through DeepSpeed's getter again, as the parameters are released. The next grad-mode open takes it as it is where
nothing changed: no hook registered on a member meanwhile, its forward still the one the lift set, and no hook of the
engine added or removed (`_version`); otherwise the hooks go back and the lift is made anew, as is a no_grad open's
(its lift has no forward of its own to guard the members, and goes back at its close). A member called while its group
is closed (on its own, between steps) finds the forward the lift set: the hooks go back and the call runs again
through them (`closed_call`). Before an open whose members claim for themselves (MemberClaims.FORWARD, RECOMPUTE), a
compiled region, a generation step, and `engine.destroy()`, the hooks go back.

[Note: lifted getters] DeepSpeed makes every module's `_parameters` a ZeROOrderedDict whose getter (z3ext's seam,
external.py) runs in Python on every parameter access (`self.weight`): a few calls each, about 150 accesses per
generated token of a 16-layer Llama, 390 per forward of a 32-layer GPT. Where the hooks are lifted, every parameter of the
module is gathered (a covered module of the resident fast path; a member of an open group, whose parameters are
its group's own), so the getter has nothing to do: for the time, the dict's class is a subclass with
OrderedDict's own lookup (deepspeed_private.GATHERED_DICT), still a ZeROOrderedDict with DeepSpeed's setter and
deleter (a parameter set meanwhile still moves the tree epoch); it is put back with the hooks. The same holds
for the modules inside a z3 leaf member of an open group, which have no hooks to lift: the leaf's unit holds their
parameters (an expert's weights, read once per expert call: 4 getter calls of Python per expert and block).
"""
from collections import OrderedDict
from functools import partial

from deepspeed.utils import z3_leaf_module

from deepspeed_z3ext.deepspeed_private import GATHERED_DICT, ZERO_DICT, zero_lookups

_NONE = object()  # a module without a `forward` of its own (lift_members)


class LiftedHooks:

    def __init__(self):
        self._hooks = {}   # id(module) -> (module, pre-hook id, post-hook id): the lift-able ones
        self._lifted = {}  # id(module) -> (module, its two hooks, or its three hook dicts' items before the lift,
                           # its parameter dict while it looks up without DeepSpeed's getter)
        self._ids = None   # the module ids lifted for
        self.member_boundary = None  # (forward, *args): a grad-mode member's call ([Note: member hooks])
        self.compiled = 0       # > 0 while a hook runs under a compiled region (hooks.py)
        self._version = 0       # moves when a hook is added or forgotten: the groups' liftable lists are rebuilt

    def add(self, module, pre_handle, post_handle):
        """A module's two hooks become lift-able; returns their handles, which forget the module when removed
        (DeepSpeed removes them to register anew, or at destroy: a lifted hook must not come back then)."""
        key = id(module)
        self._hooks[key] = (module, pre_handle.id, post_handle.id)
        self._version += 1
        return [_Handle(self, key, pre_handle), _Handle(self, key, post_handle)]

    def forget(self, key):
        self._version += 1
        self._hooks.pop(key, None)
        lifted = self._lifted.pop(key, None)
        if lifted is not None and lifted[2] is not None:
            zero_lookups(lifted[2])

    @property
    def active(self) -> bool:
        return bool(self._lifted)

    def lift(self, ids):
        """The two hooks of every module in `ids` (module ids) come out of its hook dicts."""
        if ids is self._ids:
            return  # lifted for this set already (the next token)
        self._ids = ids
        hooks, lifted = self._hooks, self._lifted
        for key in ids:
            entry = hooks.get(key)
            if entry is None or key in lifted:
                continue
            m, pre, post = entry
            pres, posts, always = m._forward_pre_hooks, m._forward_hooks, m._forward_hooks_always_called
            params = m._parameters
            if type(params) is ZERO_DICT:  # [Note: lifted getters]
                params.__class__ = GATHERED_DICT
            else:
                params = None
            if len(pres) == 1 and len(posts) == 1 and pre in pres and post in posts:
                # z3ext's hooks alone (most modules): they come back first, before any registered meanwhile
                lifted[key] = (m, (pres.pop(pre), posts.pop(post)), params)
                del always[post]
                continue
            lifted[key] = (m, [list(d.items()) for d in (pres, posts, always)], params)
            pres.pop(pre, None)
            posts.pop(post, None)
            always.pop(post, None)

    def restore(self):
        """Every lifted hook back, in its place: hooks registered meanwhile after, hooks removed meanwhile gone."""
        lifted, self._lifted, self._ids = self._lifted, {}, None
        for key, (m, before, params) in lifted.items():
            if params is not None:
                zero_lookups(params)
            _, pre, post = self._hooks[key]
            if type(before) is tuple:  # z3ext's hooks were the only ones
                _put_first(m._forward_pre_hooks, pre, before[0])
                _put_first(m._forward_hooks, post, before[1])
                m._forward_hooks_always_called[post] = True
                continue
            for d, items, ours in zip((m._forward_pre_hooks, m._forward_hooks, m._forward_hooks_always_called),
                                      before, ({pre}, {post}, {post})):
                now = OrderedDict(d)
                restored = OrderedDict((k, v) for k, v in items if k in now or k in ours)
                restored.update((k, v) for k, v in now.items() if k not in restored)
                d.clear()  # in place: a RemovableHandle holds a weak reference to this very dict
                d.update(restored)


    def lift_members(self, group, grad_enabled):
        """[Note: member hooks]: the hooks of the modules inside `group`'s owner, for the group's open forward (still
        lifted from the last grad-mode one where nothing changed meanwhile: [Note: kept lift])."""
        if self.compiled:
            if group.lifted:
                self.restore_members(group)
            return
        liftable = group.liftable
        if group.kept:
            if grad_enabled and liftable[0] == self._version and _untouched(group.lifted):
                for params in group.lifted_dicts:  # [Note: lifted getters]
                    if type(params) is ZERO_DICT:
                        params.__class__ = GATHERED_DICT
                return
            self.restore_members(group)
        if liftable is None or liftable[0] != self._version:
            liftable = group.liftable = (self._version, self._liftable(group), _leaf_dicts(group))
        boundary, out, dicts = self.member_boundary if grad_enabled else None, [], []
        for entry in liftable[1]:
            m, pre, post, pres, posts, always, attrs, forwards = entry
            if len(pres) != 1 or len(posts) != 1 or pre not in pres or post not in posts:
                continue  # another's hook beside z3ext's, or lifted for generation
            pre_fn, post_fn = pres.pop(pre), posts.pop(post)
            del always[post]
            forward = installed = None  # untouched
            if boundary is not None:
                forward = attrs.get("forward", _NONE)
                if forward is _NONE:  # the class's forward: its call with the boundary made once per module
                    cls_forward = type(m).forward
                    if forwards[0] is not cls_forward:
                        forwards[:] = cls_forward, partial(boundary, group, m, m.forward)
                    installed = forwards[1]
                else:
                    installed = partial(boundary, group, m, forward)  # the input boundary, then its forward
                attrs["forward"] = installed
            out.append((entry, pre_fn, post_fn, forward, installed))
            dicts.append(attrs["_parameters"])
        group.lifted = out
        group.kept = boundary is not None  # [Note: kept lift]
        # [Note: lifted getters]: the lifted members' parameter dicts and those of a z3 leaf member's descendants
        group.lifted_dicts = [d for d in (*dicts, *liftable[2]) if type(d) is ZERO_DICT and d]  # (an empty one: no lookup)
        for params in group.lifted_dicts:
            params.__class__ = GATHERED_DICT

    @staticmethod
    def modules(group):
        """The modules whose hooks the open `group`'s forward lifted."""
        return [entry[0] for entry, *_ in group.lifted]

    def close_members(self, group):
        """The owner's forward is over: a grad-mode lift stays, its parameter dicts look up through DeepSpeed's getter
        again ([Note: kept lift]); any other goes back."""
        if not group.kept:
            self.restore_members(group)
            return
        for params in group.lifted_dicts:
            if type(params) is GATHERED_DICT:
                params.__class__ = ZERO_DICT

    def closed_call(self, group, module, args, kwargs):
        """A member of `group` called while the group is closed, its hooks still lifted ([Note: kept lift]): they go
        back, and the call runs again through them."""
        self.restore_members(group)
        return module(*args, **kwargs)

    def restore_members(self, group):
        """What `lift_members` took out, back in its place (first: z3ext's hooks were the only ones)."""
        group.kept = False
        lifted, group.lifted = group.lifted, ()
        for params in group.lifted_dicts:  # (zero_lookups, inline)
            if type(params) is GATHERED_DICT:
                params.__class__ = ZERO_DICT
        group.lifted_dicts = ()
        hooks = self._hooks
        for (m, pre, post, pres, posts, always, attrs, _), pre_fn, post_fn, forward, installed in lifted:
            if installed is not None and attrs.get("forward") is installed:  # (one set meanwhile stays)
                if forward is _NONE:
                    del attrs["forward"]
                else:
                    attrs["forward"] = forward
            if id(m) not in hooks:
                continue  # removed meanwhile (DeepSpeed re-registering or destroying hooks)
            if pres:  # (_put_first, its usual case inline: once per member and forward)
                _put_first(pres, pre, pre_fn)
            else:
                pres[pre] = pre_fn
            if posts:
                _put_first(posts, post, post_fn)
            else:
                posts[post] = post_fn
            always[post] = True

    def _liftable(self, group):
        """The modules inside the group's owner whose hooks its open forward may lift, with their hook dicts:
        members and modules without parameters of their own ([Note: member hooks])."""
        members, out = group.member_ids, []
        for m in group.owner.modules():
            entry = self._hooks.get(id(m))
            if entry is None or m is group.owner:
                continue
            if id(m) in members or not any(p is not None for p in m._parameters.values()):
                out.append((m, entry[1], entry[2], m._forward_pre_hooks, m._forward_hooks,
                            m._forward_hooks_always_called, m.__dict__, [None, None]))
        return tuple(out)


def _untouched(lifted) -> bool:
    """Whether the kept lift's members are as it left them: no hook registered on them, and the forward it set
    still theirs ([Note: kept lift])."""
    for (_, _, _, pres, posts, _, attrs, _), _, _, _, installed in lifted:
        if pres or posts or attrs.get("forward") is not installed:
            return False
    return True


def _leaf_dicts(group):
    """The `_parameters` of the descendants of the group's z3 leaf members, which have no hooks: their parameters are in
    the leaf's unit, gathered while the group is open ([Note: lifted getters])."""
    return tuple(d._parameters for m in group.members if z3_leaf_module(m) for d in m.modules()
                 if d is not m and d._parameters)


def _put_first(d, key, value):
    if not d:
        d[key] = value
        return
    items = list(d.items())
    d.clear()  # in place: a RemovableHandle holds a weak reference to this very dict
    d[key] = value
    d.update(items)


class _Handle:
    """A hook's RemovableHandle that also tells the LiftedHooks (DeepSpeed calls `remove()` on it)."""

    def __init__(self, lifted, key, handle):
        self._lifted, self._key, self._handle = lifted, key, handle
        self.id = handle.id

    def remove(self):
        self._lifted.forget(self._key)
        self._handle.remove()
