"""Every public DP and optimizer name users had before issue 35 moved DP
into `privacy/` keeps working: the name, and the signature of the function,
of the class's constructor and of each public method a custagg class
defines (issue 35: "every public name and signature users have today keeps
working").

`public_surface_b00c58c.json` is that surface as it was at b00c58c, the
tree before the move (`custagg`'s names that `custagg.optimizers` also
offers, `custagg.optimizers`, `custagg.distributed`, `custagg.privacy` and
TF Privacy's module paths under it), read the way `surface()` reads it
here. Names may be added; none may go or change its signature.
"""

import importlib
import inspect
import json
import os

import pytest

PINNED = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "public_surface_b00c58c.json")


def _signature(f):
    try:
        return str(inspect.signature(f))
    except (TypeError, ValueError):
        return None


def surface(module_name):
    """{"module:name[.method]": what it is} for `module.__all__`."""
    module = importlib.import_module(module_name)
    out = {}
    for name in module.__all__:
        obj = getattr(module, name)
        key = module_name + ":" + name
        if inspect.ismodule(obj):
            out[key] = "module"
        elif inspect.isclass(obj):
            out[key] = "class" + (_signature(obj.__init__) or "")
            if obj.__module__.startswith("custagg"):
                for attr, value in sorted(vars(obj).items()):
                    if not attr.startswith("_") and inspect.isfunction(value):
                        out[key + "." + attr] = _signature(value)
        elif callable(obj):
            out[key] = _signature(obj)
        else:
            out[key] = type(obj).__name__
    return out


def _pinned():
    with open(PINNED) as f:
        return json.load(f)


@pytest.mark.parametrize("module_name", sorted(
    {key.split(":")[0] for key in _pinned()}))
def test_public_names_and_signatures_kept(module_name):
    pinned = {k: v for k, v in _pinned().items()
              if k.split(":")[0] == module_name}
    now = surface(module_name)
    gone = sorted(set(pinned) - set(now))
    changed = ["%s: %s -> %s" % (k, pinned[k], now[k])
               for k in sorted(set(pinned) & set(now)) if pinned[k] != now[k]]
    assert not gone and not changed, "\n".join(
        ["gone: " + k for k in gone] + ["changed: " + c for c in changed])


def test_the_check_sees_a_changed_signature(monkeypatch):
    """A fourth positional argument renamed on a pinned class is caught."""
    from custagg.privacy import wrappers
    cls = wrappers.DPAdamGaussianWrapper

    def renamed(self, l2_norm_clip, noise_multiplier, unroll_microbatches=None,
                *args, seed=None, strategy="auto", group_ids=None, **kwargs):
        pass

    monkeypatch.setattr(cls, "__init__", renamed)
    now = surface("custagg.optimizers")
    assert now["custagg.optimizers:DPAdamGaussianOptimizer"] != \
        _pinned()["custagg.optimizers:DPAdamGaussianOptimizer"]
