"""Triton kernels and their PyTorch references (the systems half: packed paged latent cache),
installed as `quantmla_kernels`.

From the repository root (`python -m ...`, pytest) this folder is also importable as a bare
`kernels`, the name of Hugging Face's hub-kernels package, which transformers >= 5.25 imports with
every model. Imported under that name, it hands the import over to the installed package (or
fails as if absent), so our folder never shadows it."""

if __name__ == "kernels":
    import importlib.util
    import os
    import sys
    from importlib.machinery import PathFinder

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = PathFinder.find_spec("kernels", _elsewhere)
    if _spec is None:
        raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module
    _spec.loader.exec_module(_module)
