"""How optimd.torch names the tensors it registers, and the other names
(aliases) of a weight tied between modules.

A parameter given as a (name, tensor) pair is registered under that name;
one given bare under a generated one ("group<i>.param<j>"). A weight tied
between modules (a GPT's embedding and LM head sharing one Parameter) is one
tensor with several names: given more than once in one group's list under
different names, as `model.named_parameters(remove_duplicate=False)` (torch
2.x) and `tied_named_parameters(model)` (any torch) give it, it is registered
once, under its first name, with the others as its aliases. Checkpoints list
the aliases, and optimd.checkpoint.to_torch_state_dict gives the tensor under
each name, so a tied model loads it with load_state_dict(..., strict=True).
"""
import functools

import torch


def tied_named_parameters(module, prefix=""):
    """(name, parameter) pairs of `module` with a tied parameter under each
    name that owns it, in named_parameters' order: what torch 2.x's
    `module.named_parameters(remove_duplicate=False)` gives, on torch 1.13
    too (whose named_parameters has no such argument)."""
    for module_name, m in module.named_modules(prefix=prefix,
                                               remove_duplicate=False):
        for name, p in m._parameters.items():
            if p is not None:
                yield (module_name + "." if module_name else "") + name, p


class ParamNames:
    """The names of an optimizer's parameters, by the parameter's id():
    the name each is registered under, and its aliases."""

    def __init__(self):
        self._names = {}
        self._aliases = {}

    def get(self, param_id, default):
        return self._names.get(param_id, default)

    def aliases_of(self, param):
        """The other names of `param`, in the order given (a list)."""
        return self._aliases.get(id(param), [])

    def strip(self, params):
        """`params` as torch's optimizer constructor takes them (tensors,
        (name, tensor) pairs or group dicts) with the names taken out and
        kept here; named parameters come back as one group carrying
        "param_names" where the installed torch keeps such names."""
        items = list(params)
        if any(isinstance(item, dict) for item in items):
            return [self.strip_group(item) if isinstance(item, dict)
                    else item for item in items]
        tensors, names = self._strip_list(items, None)
        if names is None:
            return tensors
        return [{"params": tensors, "param_names": names}]

    def strip_group(self, group):
        """A group dict with its parameters' names taken out: as torch 2.6+
        does, the names of named parameters go to "param_names"; names the
        group already has there (one per parameter) name the registrations."""
        group = dict(group)
        params = group.get("params")
        if isinstance(params, torch.Tensor) or not isinstance(
                params, (list, tuple)):
            return group  # one tensor, or what torch's own check refuses
        given = group.get("param_names")
        if not (isinstance(given, (list, tuple)) and
                len(given) == len(params) and
                all(isinstance(n, str) for n in given)):
            given = None
        tensors, names = self._strip_list(list(params), given)
        group["params"] = tensors
        if names is not None:
            group["param_names"] = names
        return group

    def _strip_list(self, items, given):
        """(tensors, their names or None): one list's parameters. A tensor
        given again under another name is left out and the name kept as its
        alias; given again under the same name it stays twice (the group
        check refuses a parameter listed twice). The names come back where
        every item was named and torch keeps names (or `given` named
        them)."""
        out, names = [], []
        first_name = {}  # id -> the name it has in this list
        named = 0
        for i, item in enumerate(items):
            if (isinstance(item, (tuple, list)) and len(item) == 2 and
                    isinstance(item[0], str)):
                name, p = item
                named += 1
            else:
                name, p = (given[i] if given else None), item
            if name is not None:
                first = first_name.get(id(p))
                if first is not None and first != name:
                    aliases = self._aliases.setdefault(id(p), [])
                    if name not in aliases:
                        aliases.append(name)
                    continue
                first_name[id(p)] = name
                self._names[id(p)] = name
            out.append(p)
            names.append(name)
        if named and torch_takes_names():
            if named != len(items):
                raise ValueError("all optimizer params should be with/without "
                                 "names. Some param names are missing")
            return out, names
        return out, (names if given else None)


@functools.lru_cache(maxsize=None)
def torch_takes_names():
    """Whether the installed torch's optimizers take (name, tensor) pairs,
    keeping the names in each group's "param_names" (torch 2.6+)."""
    probe = torch.zeros(1, requires_grad=True)
    try:
        opt = torch.optim.SGD([("probe", probe)], lr=0.1)
    except TypeError:
        return False
    return "param_names" in opt.param_groups[0]
