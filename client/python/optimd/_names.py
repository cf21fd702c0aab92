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
        """`params` (tensors, (name, tensor) pairs or group dicts) with the
        names taken out and kept here. Within one list, a tensor given again
        under another name is left out and the name kept as its alias; given
        again under the same name it stays twice (the group check refuses a
        parameter listed twice, as before)."""
        out = []
        first_name = {}  # id -> the name it has in this list
        for item in list(params):
            if isinstance(item, dict):
                group = dict(item)
                group["params"] = self.strip(group["params"])
                out.append(group)
                continue
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and
                    isinstance(item[0], str)):
                out.append(item)
                continue
            name, p = item
            first = first_name.get(id(p))
            if first is not None and first != name:
                aliases = self._aliases.setdefault(id(p), [])
                if name not in aliases:
                    aliases.append(name)
                continue
            first_name[id(p)] = name
            self._names[id(p)] = name
            out.append(p)
        return out
