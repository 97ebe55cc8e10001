"""The engine's attention, KV and elementwise ops: Triton kernels and their torch twins.

The interface is :mod:`ops` (re-exported here). Installed, this folder is the package
``mooncake_kernels``, the name our code imports: ``kernels`` is also the import name of PyPI's
``kernels`` (Hugging Face's kernel hub, which transformers 5 requires), and one process can hold
only one module of a name. Where this folder is found as ``kernels`` all the same (the checkout's
root on ``sys.path``: ``python -m ...`` or pytest from the checkout), it gives the name away: to
the other ``kernels`` on ``sys.path`` if one is installed, else to ``mooncake_kernels``
(submodules included, so both names share one set of modules). docs/engine.md#the-name-kernels.
"""

from __future__ import annotations

if __name__ != "kernels":
    from .ops import *  # noqa: F403 (the interface, ops.__all__)
    from .ops import __all__  # noqa: F401
else:
    import importlib.machinery
    import importlib.util
    import os
    import sys

    def _give_the_name_away() -> None:
        root = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        elsewhere = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
        spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
        if spec is not None:
            # Load the other package in this module's place, without importing ours (triton): an
            # import returns what sys.modules holds once the module has run, so `import kernels`
            # yields it (CPython's import system; the standard "import a source file directly"
            # recipe). Its own `from kernels.x import ...` then resolve in its folder.
            other = importlib.util.module_from_spec(spec)
            sys.modules["kernels"] = other
            spec.loader.exec_module(other)
            return
        try:
            import mooncake_kernels
        except ModuleNotFoundError as e:
            if e.name != "mooncake_kernels":
                raise
            raise ImportError(
                f"{root}/kernels/ was imported as `kernels`, a name it shares with PyPI's `kernels` "
                f"(Hugging Face's kernel hub); it is the package `mooncake_kernels`, which is not "
                f"installed: run `pip install -e {root}`") from None
        for name, module in list(sys.modules.items()):
            if name == "mooncake_kernels" or name.startswith("mooncake_kernels."):
                sys.modules["kernels" + name.removeprefix("mooncake_kernels")] = module

    _give_the_name_away()
