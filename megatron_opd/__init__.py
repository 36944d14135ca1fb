"""megatron-opd: on-policy distillation on Megatron-Core."""


def _map_source_kernels() -> None:
    """The repository's ``kernels/`` folder is ``megatron_opd.kernels``: an install maps it there (setup.py's
    ``package_dir``; a top-level ``kernels`` would collide with Hugging Face's package of that name), and a source
    checkout run without installing (``PYTHONPATH=repo``, the device machines) maps it here, before any submodule
    import, so that the checkout's own folder wins over an editable install of another one."""
    import importlib.util
    import os
    import sys

    package_dir = os.path.dirname(os.path.abspath(__file__))
    if os.path.isdir(os.path.join(package_dir, "kernels")) or f"{__name__}.kernels" in sys.modules:
        return  # an installed wheel: megatron_opd/kernels/ is there
    root = os.path.dirname(package_dir)
    init = os.path.join(root, "kernels", "__init__.py")
    if not (os.path.isfile(os.path.join(root, "setup.py")) and os.path.isfile(init)):
        return
    spec = importlib.util.spec_from_file_location(
        f"{__name__}.kernels", init, submodule_search_locations=[os.path.dirname(init)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    sys.modules[__name__].kernels = module  # what the import system does for a found submodule


_map_source_kernels()
