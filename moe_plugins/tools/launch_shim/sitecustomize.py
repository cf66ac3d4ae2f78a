"""Put on PYTHONPATH by ``moe-plugins launch``: enables moe_plugins when Megatron-core is imported if
``MOE_PLUGINS_MEGATRON`` is set, else when DeepSpeed is imported (``MOE_PLUGINS_CONFIG``); see
``moe_plugins.tools.launch_shim``. The environment is read once, here. Then runs the ``sitecustomize`` this file
shadows, if any."""


def _moe_plugins_launch_shim() -> None:
    import importlib.machinery
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        from moe_plugins.tools.launch_shim import install, install_megatron
        megatron = os.environ.get("MOE_PLUGINS_MEGATRON")
        if megatron:
            local = os.environ.get("LOCAL_WORLD_SIZE", "")
            install_megatron(megatron, ranks_per_node=int(local) if local.isdigit() and int(local) > 0 else None,
                             announce=os.environ.get("RANK", "0") == "0")
        else:
            install(os.environ.get("MOE_PLUGINS_CONFIG") or None)
    finally:
        rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
        if spec is not None and spec.loader is not None:
            shadowed = importlib.util.module_from_spec(spec)
            sys.modules["_moe_plugins_shadowed_sitecustomize"] = shadowed
            spec.loader.exec_module(shadowed)


_moe_plugins_launch_shim()
