"""The plugin sections the GPU layer scripts (layer_modes.py, layer_pair.py) run, by name; "stock": none."""

MODES = {
    "stock": None,
    "r1": {"schedule": "baseline", "pipeline_degree": 1},
    "r4": {"schedule": "baseline", "pipeline_degree": 4},
    "parm-auto": {"schedule": "parm-auto", "pipeline_degree": 1},
    "pipe-auto": {"schedule": "baseline", "pipeline_degree": "auto"},
    "lancet": {"schedule": "baseline", "lancet": {"defer_wgrad": True}},
    "hecate": {"schedule": "hecate"},
    "lina": {"schedule": "baseline", "lina": {"priority": True, "micro_op_mb": 4}},
}
