"""Host adapters, one module per host framework, installed as ``moe_plugins.patches``.

Each adapter translates the host's arguments into the core's typed config once, at the boundary, and patches
only inside enable/disable pairs that restore the originals. The core (``moe_plugins``) never imports a host.
"""
