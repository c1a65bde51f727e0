"""Triton kernels and their PyTorch references (the systems half: packed paged latent cache),
installed as `quantmla_kernels`.

From the repository root (`python -m ...`, pytest) this folder is also importable as a bare
`kernels`, the name of Hugging Face's hub-kernels package, which transformers >= 5.25 depends on
and imports with every model. Imported under that name while that package is installed, it hands
the import over to it, so our folder never shadows it (without it, it stays this empty package,
which transformers' availability check reads as a package without a version)."""

if __name__ == "kernels":
    import importlib.util
    import os
    import sys
    from importlib.machinery import PathFinder

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
